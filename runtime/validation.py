"""What a request must satisfy before it is queued: checked by the front-end (to answer 400 before anything is
sent) and again by the engine core (the trust boundary), against the same `RequestLimits`."""
from __future__ import annotations

from .errors import RequestError
from .ipc.protocol import RequestLimits
from .sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Everything the request's sequences will put in a tensor; raises `RequestError` (message starting with
    the offending field's name where there is one)."""
    params.check()  # again: the object may have changed since it was built
    if not prompt_token_ids:
        raise RequestError("the prompt is empty")
    vocab = limits.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt_token_ids):
        raise RequestError(f"prompt token ids must be ints in [0, {vocab})")
    n, max_len = len(prompt_token_ids), limits.max_model_len
    if n >= max_len:
        raise RequestError(f"the prompt has {n} tokens but max_model_len is {max_len} (prompt plus generated "
                           "tokens)")
    total = n + (params.max_tokens or max_len - n)
    if total > max_len:
        raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                           f"max_model_len {max_len}")
    blocks = -(-total // limits.block_size)
    if blocks > limits.num_blocks:
        raise RequestError(f"the request needs up to {blocks} KV blocks but the cache holds {limits.num_blocks}; "
                           "lower max_tokens or enlarge the KV cache")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise RequestError(f"{name}={value} exceeds the vocabulary size {vocab}")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise RequestError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}")
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
        raise RequestError(f"stop_token_ids must be in [0, {vocab}), got {max(params.stop_token_ids)}")
    thinking = params.thinking
    if thinking is not None:
        ids = (*thinking.start_ids, *thinking.end_ids, *thinking.force_ids)
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise RequestError(f"thinking token ids must be ints in [0, {vocab})")
        if thinking.budget is not None and not 0 <= thinking.budget <= max_len:
            raise RequestError(f"thinking budget must be in [0, {max_len}], got {thinking.budget}")
