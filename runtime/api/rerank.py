"""`POST /v1/rerank` and `POST /v1/score` in vLLM's shapes, scored the way Qwen3-Reranker is (docs/embeddings.md).

A (query, document) pair is rendered with Qwen3-Reranker's prompt (PREFIX + the instruction, query and document
in BODY + SUFFIX, each part tokenized on its own without special tokens, as the model card does) and scored by the
model's next-token logits at the last position over the tokens "yes" and "no":
score = exp(l_yes) / (exp(l_yes) + exp(l_no)).

No core support is needed: the pair's prompt is submitted twice, once followed by the "yes" token and once by the
"no" token, each a prefill with prompt logprobs; the last prompt position's logprob is log_softmax(l)[yes] (resp.
[no]), both over the same normalizer, so score = sigmoid(lp_yes - lp_no). Any generation artifact serves these
routes; a model whose tokenizer does not spell "yes" and "no" as one token each is refused (400). An embedding
artifact refuses them as it does the other generation routes (embeddings.refuse_generation).
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ..errors import KilnRuntimeError, RequestError
from ..sampling_params import SamplingParams
from .async_engine import PromptInput
from .protocol import APIError, StrictModel
from .streaming import until_disconnect

# Qwen3-Reranker's prompt (its model card's `prefix`, `format_instruction` and `suffix`)
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES, NO = "yes", "no"


class RerankRequest(StrictModel):
    model: str
    query: str
    documents: list[str]
    top_n: int | None = None  # the best top_n results; None or 0: all of them (vLLM's)
    instruction: str | None = None  # kiln's extension: the <Instruct> line (DEFAULT_INSTRUCTION)

    def check_supported(self) -> None:
        if not self.documents:
            raise APIError(400, "documents must not be empty", param="documents")
        if self.top_n is not None and self.top_n < 0:
            raise APIError(400, f"top_n must be >= 0, got {self.top_n}", param="top_n")


class ScoreRequest(StrictModel):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None

    def check_supported(self) -> None:
        for name in ("text_1", "text_2"):
            if getattr(self, name) == []:
                raise APIError(400, f"{name} must not be empty", param=name)

    def pairs(self) -> list[tuple[str, str]]:
        """One text_1 is paired with every text_2; otherwise they pair up one by one (equal lengths)."""
        t1 = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        t2 = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(t1) == 1:
            return [(t1[0], t) for t in t2]
        if len(t1) != len(t2):
            raise APIError(400, f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or as many "
                           "as text_2", param="text_2")
        return list(zip(t1, t2, strict=True))


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def single_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise APIError(400, f"this model cannot rerank: its tokenizer spells {word!r} as {len(ids)} tokens, and a "
                       "Qwen3-Reranker-style yes/no score needs it as one", param="model", code="not_a_reranker")
    return ids[0]


async def score_pairs(server: Any, model: str, pairs: list[tuple[str, str]], instruction: str | None,
                      param: str) -> tuple[list[float], int, Any]:
    """Starts scoring `pairs` (query, document): returns an awaitable of (scores, prompt tokens) and the group to
    abort when the client goes away."""
    tok = server.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer: it cannot render the reranker prompt", param="model")
    yes_id, no_id = single_token(tok, YES), single_token(tok, NO)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)  # a prefill; its one sampled token is dropped
    try:
        server.async_engine.check_admissible(2 * len(pairs), params)
    except RequestError as e:
        raise APIError(400, str(e), param=param, code="too_many_inputs") from None
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    bodies = [BODY.format(instruction=instruction, query=q, document=d) for q, d in pairs]
    prefix, suffix = tok.encode(PREFIX, add_special_tokens=False), tok.encode(SUFFIX, add_special_tokens=False)
    prompts = [prefix + ids + suffix for ids in await server.encode(bodies, add_special_tokens=False, param=param)]
    limit = server.max_model_len
    for i, p in enumerate(prompts):
        if len(p) + 1 >= limit:  # + the yes/no token, + the one sampled token
            raise APIError(400, f"This model's maximum context length is {limit} tokens: a rendered pair may have "
                           f"at most {limit - 2}; pair {i} has {len(p)}. Shorten it.", param=param,
                           code="context_length_exceeded")
    request_id = uuid.uuid4().hex
    inputs = [PromptInput(f"{request_id}-{i}-{word}", p + [tid])
              for i, p in enumerate(prompts) for word, tid in ((YES, yes_id), (NO, no_id))]
    appended = {p.request_id: p.prompt_token_ids[-1] for p in inputs}  # its logprob at the last position
    lengths = {p.request_id: len(p.prompt_token_ids) for p in inputs}
    try:
        group = await server.async_engine.add_requests(inputs, params, server.lora.lora_name(model))
    except RequestError as e:
        raise APIError(400, str(e), param=param) from None
    except KilnRuntimeError as e:  # overloaded, or the engine core is gone
        raise APIError(503, str(e), type="server_error", code="overloaded") from None

    async def collect() -> tuple[list[float], int]:
        last: dict[str, float] = {}  # request id -> the logprob of its last prompt token
        counts: dict[str, int] = {}
        try:
            async for delta in group:
                if delta.prompt_logprobs:
                    counts[delta.request_id] = counts.get(delta.request_id, 0) + len(delta.prompt_logprobs)
                    position = delta.prompt_logprobs[-1]
                    if counts[delta.request_id] == lengths[delta.request_id] and position is not None:
                        last[delta.request_id] = position[appended[delta.request_id]].logprob
        except Exception as e:  # the engine failed this request: not the client's fault
            raise APIError(500, str(e), type="server_error") from None
        if len(last) != len(inputs):
            raise APIError(500, "the engine ended a pair without its prompt logprobs", type="server_error")
        scores = [sigmoid(last[yes.request_id] - last[no.request_id]) for yes, no in zip(inputs[::2], inputs[1::2])]
        return scores, sum(map(len, prompts))

    return collect(), group


async def create_rerank(request: Request) -> JSONResponse:
    server = request.app.state.server
    req: RerankRequest = await server.parse(request, RerankRequest)
    work, group = await score_pairs(server, req.model, [(req.query, d) for d in req.documents], req.instruction,
                                    "documents")

    async def respond() -> JSONResponse:
        scores, num_tokens = await work
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [{"index": i, "document": {"text": req.documents[i]}, "relevance_score": scores[i]} for i in order]
        return JSONResponse({"id": f"rerank-{group_id(group)}", "model": server.model_name,
                             "usage": {"total_tokens": num_tokens}, "results": results})

    return await until_disconnect(request, respond(), on_close=group.abort)


async def create_score(request: Request) -> JSONResponse:
    server = request.app.state.server
    req: ScoreRequest = await server.parse(request, ScoreRequest)
    work, group = await score_pairs(server, req.model, req.pairs(), req.instruction, "text_2")

    async def respond() -> JSONResponse:
        scores, num_tokens = await work
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse({"id": f"score-{group_id(group)}", "object": "list", "created": int(time.time()),
                             "model": server.model_name, "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    return await until_disconnect(request, respond(), on_close=group.abort)


def group_id(group: Any) -> str:
    return group.inputs[0].request_id.split("-")[0]
