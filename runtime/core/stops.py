"""Token stops: the engine core ends a completion on eos (unless `ignore_eos`), on a stop token, or at its
length; stop strings are the front-end's, on text (output_processor.py)."""
from __future__ import annotations

from .sequence import Sequence


class TokenStops:
    """Checks the tokens a sequence just gained against its request's stops and the model's length."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> int:
        """Ends `seq` (sets its finish_reason) if its last token stops it. Returns 1: that token stays."""
        token, params = seq.token_ids[-1], seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_set:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return 1

    def check_each(self, seq: Sequence, m: int) -> int:
        """`check` for each of the last `m` tokens in turn (a verified speculative step); tokens after a stop are
        dropped. Returns how many of the `m` stay."""
        if m == 1:
            return self.check(seq)
        tail = seq.token_ids[-m:]
        del seq.token_ids[-m:]
        for k, token in enumerate(tail, 1):
            seq.token_ids.append(token)
            self.check(seq)
            if seq.finish_reason is not None:
                return k
        return m
