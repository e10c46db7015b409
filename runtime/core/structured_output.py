"""Constrained decoding with xgrammar: grammar specs from requests, compiled once per model and cached (LRU,
compiled on a thread pool with a timeout), each sequence's matcher state (accept, rollback, draft validation,
inactive inside a thinking block), and the step's batch bitmask: filled for all constrained rows in one call,
applied to those logits rows in one op; rows without constraints are never touched.

Where this sits: the API server turns `response_format` / `tools` into a `GrammarSpec` (chat_plan.py;
`grammar_spec.validate()` rejects what xgrammar cannot convert, with its message, as a 400) carried in
SamplingParams; the engine core compiles it (`GrammarBackend.compile_async`, off the step loop) and registers the
request with its `StructuredOutputProcessor`, the sampler's logits processor (constrained.ConstraintManager does
both).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from ..grammar_spec import (
    GrammarError,
    GrammarSpec,
    choice_ebnf,
    json_grammar,
    xgrammar_message,
)
from ..thinking import ReasoningTracker, ThinkingConfig
from .sequence import PLACEHOLDER_TOKEN

# GrammarSpec, its parsing and validate() are in grammar_spec.py (SamplingParams carries one, the API server
# validates it).

# xgrammar 0.2.8 writes JSON string characters as these classes in the grammars it generates (schemas, the
# builtin JSON grammar, structural tags' JSON arguments). The length-bounded one (minLength / maxLength) lets
# raw control characters through (a tab, \x0c: strict parsers — json.loads, pydantic — reject the output), and
# both admit UTF-16 surrogate code points, which encode to invalid UTF-8. Both become the class JSON means.
_STRING_CLASSES = (r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\r\n]')
_JSON_STRING_CLASS = r'[^\0-\x1f\"\\\ud800-\udfff]'


def _json_strings_fixed(grammar: Any) -> Any:
    """The grammar with its JSON string classes corrected (through its EBNF text), or itself when it has
    none. tests/structured checks that xgrammar still needs this."""
    import xgrammar as xgr

    text = str(grammar)
    fixed = text
    for cls in _STRING_CLASSES:
        fixed = fixed.replace(cls, _JSON_STRING_CLASS)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def eos_token_ids(model_eos: Iterable[int], tokenizer: Any = None) -> list[int]:
    """The union of every end-of-sequence id the checkpoint names (config.json via the manifest, the
    tokenizer's eos_token, generation_config.json): a grammar must allow all of them exactly where the
    output may end, or an EOS it does not know is sampled mid-string (vLLM #52146)."""
    ids = {int(t) for t in model_eos}
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        gen = (getattr(tokenizer, "generation_config", None) or {}).get("eos_token_id")
        if gen is not None:
            ids.update(int(t) for t in (gen if isinstance(gen, list) else [gen]))
    return sorted(ids)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Seq[int]) -> Any:
    """xgrammar's TokenizerInfo for kiln's Tokenizer (or a `tokenizers.Tokenizer`, or an HF tokenizer).
    `vocab_size` is the model's logits width (lm_head rows, possibly padded beyond the tokenizer): the mask
    covers every logit, so padded ids are masked too (mlc-llm #2651)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizers

    if not stop_token_ids:
        raise GrammarError("constrained decoding needs at least one end-of-sequence token id")
    from ..tokenizer import Tokenizer

    backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
    if isinstance(backend, HFTokenizers):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarBackend:
    """One per served model: xgrammar's compiler over the model's vocabulary, a bounded LRU of compiled
    grammars (and of failures, so a bad schema fails fast the next time), and compile threads off the engine's
    step loop (xgrammar releases the GIL while compiling). A compile that exceeds `compile_timeout` fails its
    request with a GrammarError; the thread cannot be cancelled and finishes in the background, its result
    cached (vLLM #14151 is this trap: keep `max_workers` small).

    At most `max_workers` compiles run within their time; one that overruns `compile_timeout` gives its slot
    back to the queue (up to `max_overdue` overrunning at once), so slow grammars — one client's 1.7 MB
    schemas — cannot hold every slot while quick ones wait behind them past their own timeout."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Seq[int], *, cache_size: int = 128,
                 max_whitespace: int | None = 8, compile_timeout: float = 10.0, max_workers: int = 2,
                 compile_threads: int = 2, max_overdue: int | None = None) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.info = tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        # kiln's LRU below bounds memory by entries; xgrammar's own cache would keep every grammar ever seen
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=compile_threads, cache_enabled=False)
        self.max_whitespace = max_whitespace
        self.compile_timeout = compile_timeout
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()  # key -> CompiledGrammar | GrammarError
        self._inflight: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self.max_workers = max_workers
        self.max_overdue = max_workers if max_overdue is None else max_overdue
        self._compile_queue: deque[tuple[GrammarSpec, Future]] = deque()  # waiting for a slot
        self._running = 0  # compiles holding a slot (within their time)
        self._overdue = 0  # compiles past compile_timeout that gave their slot back
        self._closed = False

    # Compilation ---------------------------------------------------------------------------------------------
    def _compile_now(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        c, ws = self._compiler, self.max_whitespace
        try:
            if spec.kind in ("json_object", "json_schema"):  # spec.whitespace; "any": up to ws in a row
                grammar = json_grammar(spec, ws)
            elif spec.kind == "structural_tag":
                grammar = xgr.Grammar.from_structural_tag(spec.spec)
            elif spec.kind == "regex":
                return c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                return c.compile_grammar(choice_ebnf(json.loads(spec.spec)))
            else:
                return c.compile_grammar(spec.spec) if "::=" in spec.spec else c.compile_lark(spec.spec)
            return c.compile_grammar(_json_strings_fixed(grammar))
        except Exception as e:
            raise GrammarError(f"invalid {spec.kind}: {xgrammar_message(e)}") from None

    def _store(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._inflight.pop(key, None)

    def _run(self, spec: GrammarSpec) -> Any:
        try:
            compiled = self._compile_now(spec)
        except GrammarError as e:
            self._store(spec.key, e)
            raise
        self._store(spec.key, compiled)
        return compiled

    def compile_async(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (done at once on a cache hit); concurrent requests for the same
        grammar share one compile. The future raises GrammarError when the grammar is invalid."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                if isinstance(hit, GrammarError):
                    done.set_exception(hit)
                else:
                    done.set_result(hit)
                return done
            future = self._inflight.get(key)
            if future is None:
                future = self._inflight[key] = Future()
                self._compile_queue.append((spec, future))
                self._dispatch()
            return future

    # Compile slots (called with self._lock held) --------------------------------------------------------------
    def _dispatch(self) -> None:
        while self._compile_queue and self._running < self.max_workers and not self._closed:
            spec, future = self._compile_queue.popleft()
            if not future.set_running_or_notify_cancel():
                self._inflight.pop(spec.key, None)
                continue
            self._running += 1
            threading.Thread(target=self._work, args=(spec, future), name="kiln-grammar", daemon=True).start()

    def _work(self, spec: GrammarSpec, future: Future) -> None:
        state = {"done": False, "overdue": False}
        timer = threading.Timer(self.compile_timeout, self._overrun, args=(state,))
        timer.daemon = True
        timer.start()
        try:
            future.set_result(self._run(spec))
        except Exception as e:  # the waiting requests get it; a GrammarError is cached by _run, others are not
            with self._lock:
                self._inflight.pop(spec.key, None)
            future.set_exception(e)
        finally:
            timer.cancel()
            with self._lock:
                state["done"] = True
                if state["overdue"]:
                    self._overdue -= 1
                else:
                    self._running -= 1
                self._dispatch()

    def _overrun(self, state: dict[str, bool]) -> None:
        """The compile ran past compile_timeout: its slot goes to the next queued grammar."""
        with self._lock:
            if state["done"] or self._overdue >= self.max_overdue:
                return
            state["overdue"] = True
            self._overdue += 1
            self._running -= 1
            self._dispatch()

    def result(self, future: Future, timeout: float | None = None) -> Any:
        """Waits for `compile_async`'s future at most `timeout` (default `compile_timeout`) seconds."""
        timeout = self.compile_timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise GrammarError(f"compiling the grammar took longer than {timeout:g} s; simplify the schema "
                               "(deeply nested anyOf/oneOf compile slowly)") from None

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> Any:
        """Blocking compile with the timeout (for tests and offline use; the engine uses compile_async)."""
        return self.result(self.compile_async(spec), timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queued, self._compile_queue = self._compile_queue, deque()
        for _, future in queued:
            future.cancel()

    # Per-sequence state --------------------------------------------------------------------------------------
    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


@dataclass(eq=False, slots=True)
class SequenceConstraint:
    """One sequence's constraints: a grammar matcher and/or a thinking-block tracker (which keeps the grammar
    inactive until the end tag, and forces that tag at a thinking budget). Tokens are fed with `accept`;
    `rollback(n)` undoes the last n (speculative drafts) across the tracker and the matcher alike.

    `error` is set once the grammar rejects a token the sequence was given (a draft it did not check, or a
    sampled token that escaped the mask): the constraint stops masking and the engine must finish the
    request with an error — never keep generating unconstrained output silently."""

    matcher: Any | None = None
    tracker: ReasoningTracker | None = None
    gated: bool = True  # the grammar waits for the thinking block to end (False: the grammar covers it)
    num_seen: int = 0  # output tokens fed so far
    error: str | None = None
    _to_matcher: list[bool] = field(default_factory=list)  # per fed token: did the matcher accept it

    def accept(self, tokens: Iterable[int]) -> bool:
        """Feeds tokens; False (and `error` set) when the grammar rejects one (later ones are not fed)."""
        m, tr = self.matcher, self.tracker
        for t in tokens:
            answer = tr.accept(t) if tr is not None else True
            to_matcher = m is not None and self.error is None and (answer or not self.gated) \
                and not m.is_terminated()
            if to_matcher and not m.accept_token(t):
                tr is not None and tr.rollback(1)
                self.error = f"token {t} is not allowed by the request's grammar"
                return False
            self._to_matcher.append(to_matcher)
            self.num_seen += 1
        return True

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        assert n <= len(self._to_matcher), f"rollback of {n} tokens, {len(self._to_matcher)} fed"
        k = sum(self._to_matcher[-n:])
        del self._to_matcher[-n:]
        if k:
            self.matcher.rollback(k)
        if self.tracker is not None:
            self.tracker.rollback(n)
        self.num_seen -= n

    def validate_drafts(self, drafts: Seq[int]) -> int:
        """How many leading draft tokens the constraints allow (the longest valid prefix); state unchanged.
        A forced thinking-end token counts: a draft that differs from it is invalid."""
        ok = 0
        for t in drafts:
            forced = self.forced_token()
            if forced is not None and t != forced:
                break
            if not self._accept_quietly(t):
                break
            ok += 1
        self.rollback(ok)
        return ok

    def _accept_quietly(self, t: int) -> bool:
        error = self.error
        if self.accept((t,)):
            return True
        self.error = error  # a rejected draft is not a failed request
        return False

    @property
    def masking(self) -> bool:
        """Whether the grammar constrains the next token."""
        m = self.matcher
        if m is None or self.error is not None or m.is_terminated():
            return False
        return not (self.gated and self.tracker is not None and self.tracker.in_thinking)

    def forced_token(self) -> int | None:
        return self.tracker.forced_token() if self.tracker is not None else None

    def fill_row(self, bitmask: torch.Tensor, row: int) -> bool:
        """This sequence's mask for its next token into `bitmask[row]`; False when nothing is masked."""
        forced = self.forced_token()
        if forced is not None:
            _only(bitmask, row, forced)
            return True
        if not self.masking:
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.gated and self.tracker is not None and self.tracker.may_open is not None:
            _allow(bitmask, row, self.tracker.may_open)
        return True

    def fill_draft_rows(self, drafts: Seq[int], bitmask: torch.Tensor, first_row: int) -> tuple[int, list[int]]:
        """Speculative decoding: the masks of the verification rows — before each draft, and after the last
        valid one (the bonus token) — into rows first_row, first_row+1, …; returns (number of valid drafts,
        the rows that mask something). Drafts past the first invalid one get no row (they are rejected)."""
        valid = self.validate_drafts(drafts)
        masked = []
        for j in range(valid + 1):
            if self.fill_row(bitmask, first_row + j):
                masked.append(first_row + j)
            if j < valid:
                self.accept((drafts[j],))
        self.rollback(valid)
        return valid, masked


def _bit(token: int) -> int:
    v = 1 << (token & 31)
    return v - (1 << 32) if v >= 1 << 31 else v  # int32 two's complement


def _only(bitmask: torch.Tensor, row: int, token: int) -> None:
    bitmask[row].zero_()
    bitmask[row, token >> 5] = _bit(token)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    bitmask[row, token >> 5] |= _bit(token)


@dataclass(slots=True)
class RequestConstraints:
    """What one request is constrained by (shared by its n sequences, each with its own state)."""

    grammar: Any | None = None  # a CompiledGrammar
    thinking: ThinkingConfig | None = None
    gated: bool = True


class StructuredOutputProcessor:
    """The sampler's logits processor (`Sampler.logits_processor`): called with the step's sampled logits rows
    and their sequences, it feeds each constrained sequence the tokens it gained since the last call, fills
    one shared, preallocated int32 bitmask for all constrained rows (xgrammar's BatchGrammarMatcher: one
    call, the per-row work in C++ threads), adds the rows a thinking budget forces (a single allowed token),
    and applies it in place to exactly those rows in one op — xgrammar's CPU kernel on the host, its Triton
    kernel on a GPU. A step with no constrained sequence costs one dict check.

    Requests are registered by id (`add_request`) before their first step and released (`remove_request`)
    when they finish; a request's n sequences each get their own state, keyed (request_id, index).
    Not thread-safe: the engine's step loop owns it (constrained.ConstraintManager). Requires synchronous
    sampling: a sequence whose last token is still an async-scheduling placeholder cannot be advanced, so the
    engine steps synchronously while a constrained request is registered."""

    def __init__(self, backend: GrammarBackend | None, vocab_size: int, *, max_rows: int = 256,
                 device: torch.device | str = "cpu") -> None:
        import xgrammar as xgr

        self.backend = backend
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._requests: dict[str, RequestConstraints] = {}
        self._seqs: dict[tuple[str, int], SequenceConstraint] = {}
        self._batch = xgr.BatchGrammarMatcher()
        self._allocate(max_rows)
        self.num_masked_rows = 0  # rows masked so far (metrics)

    def _allocate(self, rows: int) -> None:
        width = (self.vocab_size + 31) // 32
        pin = self.device.type == "cuda"
        self.bitmask = torch.full((rows, width), -1, dtype=torch.int32, pin_memory=pin)
        self._device_bitmask = (torch.empty((rows, width), dtype=torch.int32, device=self.device)
                                if self.device.type == "cuda" else None)

    # Requests ------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, *, grammar: Any | None = None, thinking: ThinkingConfig | None = None,
                    gated: bool = True) -> None:
        """`grammar`: a compiled grammar (GrammarBackend.compile*); `thinking`: the thinking block's ids,
        phase and budget; `gated`: the grammar starts after the thinking block (False for structural tags
        that spell the block out themselves)."""
        assert grammar is None or self.backend is not None, "a grammar needs the processor's GrammarBackend"
        if grammar is None and thinking is None:
            return
        self._requests[request_id] = RequestConstraints(grammar, thinking, gated)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        for key in [k for k in self._seqs if k[0] == request_id]:
            del self._seqs[key]

    def constraint(self, request_id: str, index: int = 0) -> SequenceConstraint | None:
        """The state of one of the request's sequences (created on first use)."""
        key = (request_id, index)
        c = self._seqs.get(key)
        if c is None:
            req = self._requests.get(request_id)
            if req is None:
                return None
            c = self._seqs[key] = SequenceConstraint(
                matcher=self.backend.matcher(req.grammar) if req.grammar is not None else None,
                tracker=ReasoningTracker(req.thinking) if req.thinking is not None else None, gated=req.gated)
        return c

    def errors(self) -> dict[tuple[str, int], str]:
        """Sequences whose grammar rejected a token: the engine finishes them with an error."""
        return {k: c.error for k, c in self._seqs.items() if c.error is not None}

    # The step ------------------------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, seqs: Seq[Any]) -> None:
        """Masks `logits` (row j belongs to seqs[j]) in place."""
        if not self._requests:
            return
        grammar_rows: list[int] = []
        matchers: list[Any] = []
        may_open: list[tuple[int, int]] = []  # (row, start tag): the model may still open a thinking block
        forced: list[tuple[int, int]] = []  # (row, token): a thinking budget forces the token
        for j, seq in enumerate(seqs):
            c = self.constraint(seq.request_id, seq.index)
            if c is None:
                continue
            new = seq.token_ids[seq.num_prompt_tokens + c.num_seen:]
            if new:
                assert PLACEHOLDER_TOKEN not in new, \
                    f"seq {seq.seq_id}: constrained sampling needs the previous token (async scheduling is on)"
                c.accept(new)
            token = c.forced_token()
            if token is not None:
                forced.append((j, token))
            elif c.masking:
                grammar_rows.append(j)
                matchers.append(c.matcher)
                if c.gated and c.tracker is not None and c.tracker.may_open is not None:
                    may_open.append((j, c.tracker.may_open))
        if not grammar_rows and not forced:
            return
        if len(seqs) > self.bitmask.shape[0]:
            self._allocate(max(len(seqs), 2 * self.bitmask.shape[0]))
        mask = self.bitmask
        if grammar_rows:
            self._batch.batch_fill_next_token_bitmask(matchers, mask, grammar_rows)
        for j, token in may_open:
            _allow(mask, j, token)
        for j, token in forced:
            _only(mask, j, token)
        rows = sorted(grammar_rows + [j for j, _ in forced])
        self.apply(logits, rows)
        self.num_masked_rows += len(rows)

    def mask_drafts(self, logits: torch.Tensor, seqs: Seq[Any], first_rows: Seq[int]) -> list[int]:
        """Speculative decoding's verification rows: seqs[i] with drafts `seq.draft_token_ids` owns logits rows
        first_rows[i] (the target's token after its last token), +1 (after the first draft), …. Masks the
        rows up to and including the one after its last grammar-valid draft, so the target cannot pick a
        token the grammar forbids and a draft the grammar rejects is rejected by verification itself (the
        target's masked choice never equals it). Returns each sequence's number of grammar-valid drafts.
        The sequences' states advance by the tokens they gained first, as in `__call__`."""
        valid: list[int] = []
        rows: list[int] = []
        need = max((r + len(s.draft_token_ids) + 1 for s, r in zip(seqs, first_rows)), default=0)
        if need > self.bitmask.shape[0]:
            self._allocate(max(need, 2 * self.bitmask.shape[0]))
        for s, first in zip(seqs, first_rows, strict=True):
            c = self.constraint(s.request_id, s.index)
            if c is None:
                valid.append(len(s.draft_token_ids))
                continue
            new = s.token_ids[s.num_prompt_tokens + c.num_seen:]
            if new:
                assert PLACEHOLDER_TOKEN not in new, f"seq {s.seq_id}: a placeholder in a constrained sequence"
                c.accept(new)
            n, masked = c.fill_draft_rows(s.draft_token_ids, self.bitmask, first)
            valid.append(n)
            rows.extend(masked)
        if rows:
            rows.sort()
            self.apply(logits, rows)
            self.num_masked_rows += len(rows)
        return valid

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Applies bitmask rows `rows` to the same logits rows, in one op."""
        import xgrammar as xgr

        if logits.device.type == "cuda":
            hi = rows[-1] + 1
            dev = self._device_bitmask[:hi]
            dev.copy_(self.bitmask[:hi], non_blocking=True)  # from pinned host memory: no sync with the step
            xgr.apply_token_bitmask_inplace(logits, dev, vocab_size=self.vocab_size, indices=rows)
            return
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size, indices=rows,
                                        backend="cpu")
