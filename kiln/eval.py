"""`kiln eval`: perplexity of an artifact on a text, and the KL divergence between two artifacts.

Both need next-token distributions at every position of a long text, which the serving path does not return
(it samples, and `prompt_logprobs` gives top-k only). So the evaluator runs an artifact's generated model
directly, through the runtime's public pieces: `load_artifact` (model, tokenizer, KV geometry), a private
paged KV pool of the artifact's KV dtype, and one prefill `ForwardBatch` per window with `logits_indices`
covering every position. The numbers are therefore the served model's, KV-cache quantization included (the
attention kernel writes K/V to the cache and reads the context back from it, also within a prefill).

Sliding windows (as Hugging Face's perplexity guide): windows of `max_tokens` start every `stride` tokens;
each window scores only the tokens the previous one did not, with up to `max_tokens - stride` tokens of context.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.runtime.artifact import LoadedArtifact, load_artifact
from kiln.runtime.errors import RequestError
from kiln.runtime.forward_batch import ForwardBatch


class ArtifactScorer:
    """Full-vocabulary log-probabilities of an artifact's model over one token sequence at a time."""

    def __init__(self, artifact: str | Path | LoadedArtifact, max_tokens: int, device: str = "cpu"):
        self.art = artifact if isinstance(artifact, LoadedArtifact) else load_artifact(artifact, device)
        kv = self.art.kv_cache_config
        self.max_tokens = min(max_tokens, self.art.model_config.max_model_len)
        self.block_size = kv.block_size
        num_blocks = -(-self.max_tokens // kv.block_size)
        self.kv_caches = [torch.zeros((num_blocks, *kv.shape), dtype=kv.dtype, device=self.art.device)
                          for _ in range(kv.num_layers)]
        self.block_table = list(range(num_blocks))

    @torch.inference_mode()
    def log_probs(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 [T, vocab]: row t is log p(· | token_ids[:t + 1]), from one prefill over a fresh cache."""
        n = len(token_ids)
        assert 0 < n <= self.max_tokens, f"{n} tokens; this scorer holds at most {self.max_tokens}"
        dev = self.art.device

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        used = -(-n // self.block_size)
        batch = ForwardBatch(input_ids=i32(token_ids), positions=i32(list(range(n))), query_start_loc=i32([0, n]),
                             seq_lens=i32([n]), block_tables=i32([self.block_table[:used]]),
                             slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
                             logits_indices=i32(list(range(n))), num_decodes=0)
        return self.art.model.forward(batch, self.kv_caches).float().log_softmax(-1)

    def encode(self, text: str) -> list[int]:
        if self.art.tokenizer is None:
            raise RequestError(f"{self.art.path} has no tokenizer; pass token ids")
        return self.art.tokenizer.encode(text)


def windows(num_tokens: int, max_tokens: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window. Positions are scored at most once, each with the
    window's earlier tokens as context; a window's first token has none, so with stride == max_tokens it is
    skipped (as in Hugging Face's recipe). stride < max_tokens scores every position but 0."""
    assert max_tokens > 1 and 0 < stride <= max_tokens, "need 1 < max_tokens and 0 < stride <= max_tokens"
    prev_end = 1
    for begin in range(0, max(1, num_tokens - 1), stride):
        end = min(begin + max_tokens, num_tokens)
        first = max(prev_end, begin + 1)
        if end > first:
            yield begin, end, first
        prev_end = max(prev_end, end)
        if end == num_tokens:
            break


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens


@dataclass(frozen=True)
class Comparison:
    a: Perplexity
    b: Perplexity
    kl: float  # mean over scored positions of KL(p_a || p_b), nats
    max_kl: float
    top1_agreement: float  # fraction of positions where both argmaxes agree


def _score(log_probs: torch.Tensor, ids: torch.Tensor, begin: int, first: int, end: int) -> torch.Tensor:
    rows = log_probs[first - 1 - begin:end - 1 - begin]  # rows predicting positions first..end-1
    return rows.gather(1, ids[first:end, None])[:, 0]


def _nll(total: float, count: int) -> Perplexity:
    nll = total / max(1, count)
    return Perplexity(ppl=math.exp(nll), nll=nll, tokens=count)


def _windows(num_tokens: int, max_tokens: int, stride: int, progress: bool | None) -> Iterator[tuple[int, int, int]]:
    """`windows`, with a progress bar (windows scored, tokens) on stderr: `progress` None shows it on a terminal."""
    from tqdm import tqdm

    spans = list(windows(num_tokens, max_tokens, stride))
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=sum(end - first for _, end, first in spans), unit="tok", unit_scale=True, desc="scoring",
              disable=not show, file=sys.stderr) as bar:
        for begin, end, first in spans:
            yield begin, end, first
            bar.update(end - first)


def perplexity(scorer: ArtifactScorer, token_ids: list[int], stride: int | None = None, *,
               progress: bool | None = None) -> Perplexity:
    ids = torch.tensor(token_ids, dtype=torch.int64)
    stride = stride or max(1, scorer.max_tokens // 2)
    total, count = 0.0, 0
    for begin, end, first in _windows(len(token_ids), scorer.max_tokens, stride, progress):
        lp = scorer.log_probs(token_ids[begin:end])
        total -= float(_score(lp, ids, begin, first, end).sum())
        count += end - first
    return _nll(total, count)


def compare(a: ArtifactScorer, b: ArtifactScorer, token_ids: list[int], stride: int | None = None, *,
            progress: bool | None = None) -> Comparison:
    """Perplexities of both on `token_ids` and KL(a || b) of their next-token distributions (a: reference)."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    max_tokens = min(a.max_tokens, b.max_tokens)
    stride = stride or max(1, max_tokens // 2)
    nll_a = nll_b = kl_sum = 0.0
    kl_max, agree, count = 0.0, 0, 0
    for begin, end, first in _windows(len(token_ids), max_tokens, stride, progress):
        la, lb = a.log_probs(token_ids[begin:end]), b.log_probs(token_ids[begin:end])
        nll_a -= float(_score(la, ids, begin, first, end).sum())
        nll_b -= float(_score(lb, ids, begin, first, end).sum())
        ra, rb = la[first - 1 - begin:end - 1 - begin], lb[first - 1 - begin:end - 1 - begin]
        kl = (ra.exp() * (ra - rb)).sum(-1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((ra.argmax(-1) == rb.argmax(-1)).sum())
        count += end - first
    return Comparison(_nll(nll_a, count), _nll(nll_b, count), kl_sum / max(1, count), kl_max, agree / max(1, count))


def _tokens(scorer: ArtifactScorer, text_file: str | Path, limit: int | None) -> list[int]:
    ids = scorer.encode(Path(text_file).read_text(encoding="utf-8"))
    ids = ids[:limit] if limit else ids
    if len(ids) < 2:
        raise RequestError(f"{text_file}: fewer than two tokens to score")
    return ids


def eval_ppl(artifact: str | Path, text_file: str | Path, *, max_tokens: int = 512, stride: int | None = None,
             limit: int | None = None, progress: bool | None = None) -> Perplexity:
    scorer = ArtifactScorer(artifact, max_tokens)
    return perplexity(scorer, _tokens(scorer, text_file, limit), stride, progress=progress)


def eval_compare(a: str | Path, b: str | Path, text_file: str | Path, *, max_tokens: int = 512,
                 stride: int | None = None, limit: int | None = None, progress: bool | None = None) -> Comparison:
    sa, sb = ArtifactScorer(a, max_tokens), ArtifactScorer(b, max_tokens)
    ids = _tokens(sa, text_file, limit)
    if sb.encode("kiln tokenizer check") != sa.encode("kiln tokenizer check"):
        raise RequestError(f"{a} and {b} tokenize differently; KL needs one vocabulary")
    return compare(sa, sb, ids, stride, progress=progress)


__all__ = ["ArtifactScorer", "Comparison", "Perplexity", "compare", "eval_compare", "eval_ppl", "perplexity",
           "windows"]
