"""Sampler: turns a step's logits into next tokens and log-probabilities, vectorised over the batch."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..worker.interface import host_to_device
from .batch import LogitsLayout
from .sequence import Sequence

# (token ids, logprobs, ranks) of one position: the chosen/actual token first, then the top-N.
TokenLogprobs = tuple[list[int], list[float], list[int]]
# Per-request constraints (grammars, thinking budgets): masks the sampled rows in place, row j for seqs[j]
# (runtime/structured_output.StructuredOutputProcessor).
LogitsProcessor = Callable[[torch.Tensor, list[Sequence]], None]
# Stands, in the tokens read back to the host, for a row whose logits were not finite (NaN or +-inf): the
# engine fails that row's request. Never a real id (and not sequence.PLACEHOLDER_TOKEN).
NONFINITE_TOKEN = -2


@dataclass(slots=True)
class SamplerOutput:
    """Per batch sequence (parallel to `ScheduledBatch.seqs`)."""

    sampled: list[int | None]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[list[TokenLogprobs] | None]

    def subset(self, indices: list[int]) -> SamplerOutput:
        if len(indices) == len(self.sampled):
            return self
        return SamplerOutput([self.sampled[i] for i in indices], [self.logprobs[i] for i in indices],
                             [self.prompt_logprobs[i] for i in indices])


class Sampler:
    """Logit bias -> constraints (the logits processor) -> penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample.

    Sampling draws `probs / Exponential(1)` and takes the argmax (the Gumbel-max trick in exponential form);
    each row draws its noise from its own sequence's generator when the request is seeded, so a seeded
    request gets the same tokens whatever else shares the batch. Logprobs are the log-softmax of the raw
    logits (before penalties and temperature), as vLLM reports them by default.

    A row nothing can be sampled from, its logits holding a NaN or a +inf or no finite value at all (a broken
    model: a NaN weight, a bad norm epsilon), comes back as `NONFINITE_TOKEN`. The greedy pass finds those rows
    for free: it takes each row's max, not just its argmax, and NaN and +inf propagate through a max
    (penalties keep them, and their bounds keep finite logits finite); a -inf among finite logits only rules
    its token out, as a mask does. On a device the mark is written into the tokens before their one host
    read; on the CPU reading the B row maxima costs less than the two tensor ops that would write it.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 logits_processor: LogitsProcessor | None = None) -> None:
        # Unseeded requests share this one. Generators live on the logits' device: a CPU generator cannot
        # fill a CUDA tensor, and drawing on the host and copying would cost a vocab-sized transfer per row.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Applied by `sample` to the rows it samples, before penalties and sampling (logprobs then see the
        # masked logits). Not applied on the async path (`sample_on_device`): the engine steps synchronously
        # while a constrained request runs. Speculative verification rows (`sample_tokens`) are masked by the
        # processor's `mask_drafts`, called by SpeculativeDecoder.verify.
        self.logits_processor = logits_processor

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, layout: LogitsLayout, seqs: list[Sequence]) -> SamplerOutput:
        n = len(seqs)
        out = SamplerOutput(sampled=[None] * n, logprobs=[None] * n, prompt_logprobs=[None] * n)
        for i, rows in enumerate(layout.prompt_rows):
            if rows is not None:
                first, count, pos = rows
                targets = seqs[i].token_ids[pos + 1:pos + 1 + count]
                out.prompt_logprobs[i] = _gather_logprobs(
                    torch.log_softmax(logits[first:first + count], dim=-1), targets,
                    seqs[i].params.prompt_logprobs)

        idx = [i for i, r in enumerate(layout.sample_rows) if r is not None]
        if not idx:
            return out
        row_ids = [layout.sample_rows[i] for i in idx]
        # Steady decode samples every logits row in order: no gather (a copy of the whole [B, vocab] block).
        rows = logits if row_ids == list(range(logits.shape[0])) else logits[row_ids]
        batch = [seqs[i] for i in idx]
        apply_logit_bias(rows, batch)  # before any mask: a bias never lifts a token a grammar rules out
        if self.logits_processor is not None:
            self.logits_processor(rows, batch)
        tokens = self._sample_rows(rows, batch)
        for j, i in enumerate(idx):
            out.sampled[i] = tokens[j]
        want = [j for j, s in enumerate(batch) if s.params.logprobs is not None and tokens[j] != NONFINITE_TOKEN]
        if want:
            lps = self.token_logprobs(rows[want], [tokens[j] for j in want], [batch[j].params.logprobs for j in want])
            for j, lp in zip(want, lps, strict=True):
                out.logprobs[idx[j]] = lp
        return out

    @staticmethod
    def token_logprobs(logits: torch.Tensor, tokens: list[int], top_ns: list[int]) -> list[TokenLogprobs]:
        """Row j's logprob of tokens[j] and its top_ns[j] likeliest tokens (the log-softmax of the rows given)."""
        gathered = _gather_logprobs(torch.log_softmax(logits, dim=-1), tokens, max(top_ns))
        return [(ids[:1 + n], lps[:1 + n], ranks[:1 + n]) for (ids, lps, ranks), n in zip(gathered, top_ns, strict=True)]

    @torch.inference_mode()
    def sample_tokens(self, logits: torch.Tensor, seqs: list[Sequence],
                      drafts: list[list[int]] | None = None) -> list[int]:
        """One token per row, row j with seqs[j]'s parameters and generator, its penalties counting `drafts[j]`
        as output tokens too (speculative decoding's verification rows: the target model's token after each
        draft, those before it included). `logits` is left as it is."""
        if any(s.params.logit_bias for s in seqs):
            logits = logits.clone()
            apply_logit_bias(logits, seqs)
        return self._sample_rows(logits, seqs, drafts)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, layout: LogitsLayout,
                         seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Async scheduling: the next token of every sampled sequence as a device tensor, row r of it from
        logits row r, without reading anything back; and the same tokens marked with `NONFINITE_TOKEN`, the
        tensor to read back (the first is always a valid id: the next step's input may gather it on the
        device). The step has no prompt-logprob rows, logprobs or penalties (the engine runs such steps
        synchronously), so every logits row is a sample row."""
        batch = [seqs[i] for i, r in enumerate(layout.sample_rows) if r is not None]
        assert len(batch) == logits.shape[0], f"{logits.shape[0]} logits rows for {len(batch)} sampled seqs"
        assert not any(s.params.has_penalties for s in batch), "penalties read the previous token on the host"
        apply_logit_bias(logits, batch)
        tokens, top = self._sample_tensor(logits, batch)
        return tokens, tokens.where(top.isfinite(), NONFINITE_TOKEN)

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None
                     ) -> list[int]:
        tokens, top = self._sample_tensor(logits, seqs, drafts)
        if tokens.device.type != "cpu":
            return tokens.where(top.isfinite(), NONFINITE_TOKEN).tolist()
        ids = tokens.tolist()
        tops = top.tolist()
        if all(map(math.isfinite, tops)):
            return ids
        return [t if math.isfinite(v) else NONFINITE_TOKEN for t, v in zip(ids, tops, strict=True)]

    def _sample_tensor(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, top): a token per row, always a valid id (a broken row's is meaningless), and the row's
        max logit, finite unless nothing can be sampled from the row (see the class docstring)."""
        params = [s.params for s in seqs]
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits.clone(), seqs, drafts)
        top, greedy_tokens = logits.max(dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens, top

        device = logits.device

        def vec(values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
            return host_to_device(values, dtype, device)  # no sync with the step in flight

        greedy = vec([p.greedy for p in params])
        temperature = vec([p.temperature if not p.greedy else 1.0 for p in params])
        x = logits / temperature.unsqueeze(1)
        max_k = None  # the most logits a row keeps finite after top-k (None: no top-k)
        if any(p.top_k > 0 for p in params):
            vocab = x.shape[1]
            max_k = min(vocab, max(p.top_k if p.top_k > 0 else vocab for p in params))
            x = apply_top_k(x, vec([p.top_k for p in params]), max_k=max_k)
        if any(p.top_p < 1.0 for p in params):
            x = apply_top_p(x, vec([p.top_p for p in params], x.dtype), max_k=max_k)
        if any(p.min_p > 0.0 for p in params):
            x = apply_min_p(x, vec([p.min_p for p in params], x.dtype))
        probs = torch.softmax(x, dim=-1)
        # Unseeded rows draw in one call from the shared generator; seeded rows then redraw from their own,
        # so a seeded request's tokens do not depend on what else shares the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, seq in enumerate(seqs):
            if not params[j].greedy and seq.generator is not None:
                noise[j].exponential_(generator=seq.generator)
        sampled = (probs / noise.where(~greedy.unsqueeze(1), 1.0)).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled), top


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Adds row j's request `logit_bias` to row j of `logits`, in place, in one scatter for the whole batch;
    rows of requests without one are untouched (and a batch without any costs one scan of the params)."""
    if not any(s.params.logit_bias for s in seqs):
        return
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for j, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            rows += [j] * len(bias)
            cols += bias.keys()
            values += bias.values()
    device = logits.device
    index = host_to_device([rows, cols], torch.int64, device)
    logits.index_put_((index[0], index[1]), host_to_device(values, logits.dtype, device), accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None
                    ) -> torch.Tensor:
    """vLLM semantics: repetition penalty over prompt and output tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens only. `drafts[j]`: tokens row j's
    position comes after beyond seqs[j]'s own (speculative verification), counted as output tokens."""
    vocab, device = logits.shape[1], logits.device
    counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for j, seq in enumerate(seqs):
        out_ids = seq.output_token_ids if drafts is None else seq.output_token_ids + drafts[j]
        if out_ids:
            ids = torch.tensor(out_ids, device=device)
            counts[j] = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
        seen[j, torch.tensor(seq.prompt_token_ids, device=device)] = True
    seen |= counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    rep = column([s.params.repetition_penalty for s in seqs])
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    freq = column([s.params.frequency_penalty for s in seqs])
    pres = column([s.params.presence_penalty for s in seqs])
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keeps each row's k largest logits (k <= 0: row untouched). `max_k`, the largest effective k when the
    caller knows it on the host, saves reading it back from the device (a sync under async scheduling)."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = logits.topk(max_k if max_k is not None else int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


# apply_top_p on the CPU: rows are sorted whole only when their top-p set is not among this many most likely tokens
TOP_P_CANDIDATES = 1024


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches p (always at least one; p >= 1 keeps the
    row). `max_k`: at most this many logits per row are finite (after apply_top_k), as the caller knows.

    Sorting whole rows of a large vocabulary costs more than the rest of sampling together, and the set is
    almost always among a row's few hundred most likely tokens: on the CPU the candidates (`max_k`, else
    TOP_P_CANDIDATES) come from one topk, their probabilities from the row's logsumexp, and the rows are sorted
    whole only when some row's set reaches beyond them. Not on a device: the check reads back a flag (a sync)."""
    vocab = logits.shape[1]
    k = min(vocab, max_k or TOP_P_CANDIDATES)
    if logits.device.type == "cpu" and k < vocab:
        values, order = logits.topk(k, dim=-1)  # descending
        probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        keep_row = top_p >= 1.0
        if bool(((probs.sum(dim=-1) >= top_p) | keep_row).all()):  # every row's set is among the candidates
            keep_sorted = probs.cumsum(dim=-1) - probs < top_p.unsqueeze(1)
            keep_sorted[:, 0] = True
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, keep_sorted)
            return logits.masked_fill(~(keep | keep_row.unsqueeze(1)), float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _gather_logprobs(logprobs: torch.Tensor, chosen: list[int], top_n: int | None) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and 1-based rank, then the top-N tokens (ranks 1..N)."""
    chosen_t = torch.tensor(chosen, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen_t)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_n = top_n or 0
    top = logprobs.topk(top_n, dim=-1) if top_n else None
    result = []
    for r in range(logprobs.shape[0]):
        ids, lps, rks = [chosen[r]], [float(chosen_lp[r, 0])], [int(ranks[r])]
        if top is not None:
            ids += top.indices[r].tolist()
            lps += top.values[r].tolist()
            rks += list(range(1, top_n + 1))
        result.append((ids, lps, rks))
    return result
