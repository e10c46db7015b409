"""The front-end half of a request: detokenizing, stop strings and decoded logprobs over the core's token deltas.

The engine core sends token ids (ipc/protocol.py: SeqDelta); this turns them into text, cuts the text at the
first stop string (and tells the caller which completions that ended, so the core stops computing them), and
keeps each completion's state so that either a snapshot (`RequestOutput`, what `LLMEngine.step()` and
`LLM.generate` return) or the new part since the previous call (`RequestDelta`, what the server streams) can
be taken. The API server and the in-process `LLMEngine` use it alike.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..ipc.protocol import SeqDelta, TokenLogprobs
from ..outputs import (
    CompletionDelta,
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestDelta,
    RequestOutput,
)
from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # what `take_delta` handed out so far
    sent_chars: int = 0


@dataclass(slots=True)
class RequestState:
    """One request's outputs so far. `holdback`: characters of text withheld from deltas while a completion
    is unfinished, since a stop string that completes later cuts them off. `owner` is the caller's (the
    server's RequestGroup)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    holdback: int
    num_unfinished: int
    error: str | None = None
    owner: Any = None
    sent_prompt_logprobs: int = 0  # what `take_delta` handed out so far
    embedding: list[float] | None = None  # an embedding artifact's result (its final delta carries it)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass(slots=True)
class Processed:
    """What one batch of deltas did: the requests it touched (in order of first touch), the completions that
    a stop string ended and the requests that failed here: the core must be told to stop both."""

    touched: list[RequestState]
    finish_in_core: list[tuple[str, int]]
    abort_in_core: list[str]


class OutputProcessor:
    """Per request state, fed by `process(deltas)`. A request whose detokenizing or stop check raises is failed
    alone (finish_reason "error", `RequestState.error` says why) and listed in `Processed.abort_in_core`."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, owner: Any = None) -> RequestState:
        tok = self.tokenizer
        seqs = [SeqState(i, IncrementalDetokenizer(tok, prompt_token_ids, params.skip_special_tokens)
                         if tok is not None else None, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, seqs,
                             [None] if params.prompt_logprobs is not None else None,
                             holdback=max((len(s) for s in params.stop_strings), default=1) - 1,
                             num_unfinished=params.n, owner=owner)
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> RequestState | None:
        """Forgets a request, its unfinished completions ending with "abort"; None if it was not here."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._end(state, "abort")
        return state

    def process(self, deltas: list[SeqDelta]) -> Processed:
        touched: dict[str, RequestState] = {}
        finish_in_core: list[tuple[str, int]] = []
        abort_in_core: list[str] = []
        requests = self.requests
        for d in deltas:
            state = requests.get(d.request_id)
            if state is None:  # aborted, or finished here while the core went on
                continue
            touched[d.request_id] = state
            seq = state.seqs[d.index]
            if seq.finish_reason is not None:
                continue
            if d.error is not None:  # the core failed the request
                self._fail(state, d.error)
                continue
            try:
                stopped = self._apply(state, seq, d)
            except Exception as e:  # this request's detokenizer or stop strings: its failure alone
                logger.warning("request %s failed: %s: %s", d.request_id, type(e).__name__, e)
                self._fail(state, f"the engine failed to process this request's output: {type(e).__name__}: {e}")
                abort_in_core.append(d.request_id)
                continue
            if stopped:
                finish_in_core.append((d.request_id, d.index))
            if seq.finish_reason is not None:
                state.num_unfinished -= 1
                if state.num_unfinished == 0:
                    del requests[d.request_id]
        return Processed(list(touched.values()), finish_in_core, abort_in_core)

    def _apply(self, state: RequestState, seq: SeqState, d: SeqDelta) -> bool:
        """Appends the delta's tokens; True when a stop string ended the completion before the core did
        (the tokens after the one completing it are dropped)."""
        if d.prompt_logprobs:
            state.prompt_logprobs.extend(map(self._decode_logprobs, d.prompt_logprobs))
        if d.embedding is not None:
            state.embedding = d.embedding
        ids, lps, detok = d.token_ids, d.logprobs, seq.detokenizer
        stops = state.params.stop_strings
        shown = len(ids) - (d.finish_reason == "stop")  # eos or a stop token: its text is never shown
        for k, token in enumerate(ids):
            seq.token_ids.append(token)
            if lps is not None:
                seq.logprobs.append(self._decode_logprobs(lps[k]))
                seq.cumulative_logprob += lps[k][1][0]
            if detok is not None and k < shown:
                before = len(seq.text)
                detok.add_tokens([token])
                seq.text = detok.text
                if stops and _truncate_at_stop(seq, stops, before):
                    return d.finish_reason is None
        if d.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = d.finish_reason, d.stop_reason
        return False

    def _decode_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        ids, lps, ranks = entry
        tok = self.tokenizer
        out: PositionLogprobs = {}
        for tid, lp, rank in zip(ids, lps, ranks):
            if tid not in out:
                out[tid] = Logprob(lp, rank, tok.decode_piece(tid, False) if tok is not None else None)
        return out

    def _fail(self, state: RequestState, error: str) -> None:
        state.error = error
        self._end(state, "error")
        self.requests.pop(state.request_id, None)

    @staticmethod
    def _end(state: RequestState, reason: FinishReason) -> None:
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
        state.num_unfinished = 0

    # Outputs ----------------------------------------------------------------------------------------------
    @staticmethod
    def snapshot(state: RequestState) -> RequestOutput:
        """The request's output so far; token ids and logprobs are copied (the request keeps growing)."""
        completions = [CompletionOutput(s.index, s.text, s.token_ids[:],
                                        s.cumulative_logprob if s.logprobs is not None else None,
                                        s.logprobs[:] if s.logprobs is not None else None,
                                        s.finish_reason, s.stop_reason) for s in state.seqs]
        plp = state.prompt_logprobs
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, plp[:] if plp else None,
                             completions, state.finished, state.error)

    @staticmethod
    def take_delta(state: RequestState) -> RequestDelta:
        """The new part of each completion since the previous call. Text is withheld by `holdback` chars until
        the completion ends, so a stop string that completes later never shows up (it is cut from the text)."""
        completions = []
        for seq in state.seqs:
            finished = seq.finish_reason is not None
            start_tok, start_chr = seq.sent_tokens, seq.sent_chars
            if start_chr < 0:  # its final delta went out already
                continue
            text = seq.text
            end_chr = len(text) if finished else max(start_chr, len(text) - state.holdback)
            new_ids = seq.token_ids[start_tok:]
            if not (new_ids or end_chr > start_chr or finished):
                continue
            seq.sent_tokens = len(seq.token_ids)
            seq.sent_chars = -1 if finished else end_chr
            completions.append(CompletionDelta(seq.index, text[start_chr:end_chr], new_ids,
                                               seq.logprobs[start_tok:] if seq.logprobs is not None else None,
                                               seq.finish_reason, seq.stop_reason))
        plp = state.prompt_logprobs
        new_plp = None
        if plp is not None and len(plp) > state.sent_prompt_logprobs:
            new_plp = plp[state.sent_prompt_logprobs:]
            state.sent_prompt_logprobs = len(plp)
        return RequestDelta(state.request_id, completions, len(state.prompt_token_ids), state.finished,
                            prompt_logprobs=new_plp, embedding=state.embedding)


def _truncate_at_stop(seq: SeqState, stops: list[str], before: int) -> bool:
    """Ends `seq` at the earliest stop string in its text that the last token completed (the search starts
    where a stop string ending in the new text could begin)."""
    text = seq.text
    found: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, before - len(stop) + 1))
        if at != -1 and (found is None or at < found[0]):
            found = (at, stop)
    if found is None:
        return False
    seq.text = text[:found[0]]
    seq.finish_reason, seq.stop_reason = "stop", found[1]
    return True
