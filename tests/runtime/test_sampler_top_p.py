"""apply_top_p's CPU fast path (candidates from one topk, whole-row sort only when a row's set reaches beyond
them) against the whole-row sort it replaces."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime.core import sampler
from kiln.runtime.core.sampler import apply_top_k, apply_top_p


def _sorted_reference(logits, top_p):
    """The whole-row sort (what apply_top_p does for a vocabulary of at most TOP_P_CANDIDATES)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))


@pytest.fixture
def sorts(monkeypatch):
    """Counts whole-row sorts."""
    calls = []
    real = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: calls.append(self.shape) or real(self, *a, **kw))
    return calls


@pytest.mark.parametrize("vocab", [1500, 32000])
def test_peaked_rows_take_the_candidates_and_match_the_sort(vocab, sorts):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=g) * 6  # a few hundred tokens carry the mass, as an LM's rows do
    top_p = torch.tensor([0.9, 0.5, 0.01, 0.99, 0.7, 0.95, 0.3])
    got = apply_top_p(logits, top_p)
    assert not sorts  # the fast path
    ref = _sorted_reference(logits, top_p)
    assert torch.equal(got.isfinite(), ref.isfinite()) and torch.equal(got[got.isfinite()], logits[got.isfinite()])
    assert int(got[2].isfinite().sum()) == 1  # p = 0.01: the top token alone


def test_a_row_whose_set_is_not_among_the_candidates_sorts_whole_rows(sorts):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5000, generator=g) * 6
    logits[1] = torch.randn(5000, generator=g) * 0.1  # flat: 0.9 of the mass is spread over ~4,500 tokens
    top_p = torch.tensor([0.9, 0.9, 0.5])
    got = apply_top_p(logits, top_p)
    assert len(sorts) == 1 and int(got[1].isfinite().sum()) > sampler.TOP_P_CANDIDATES
    assert torch.equal(got.isfinite(), _sorted_reference(logits, top_p).isfinite())


def test_rows_with_p_one_keep_every_token(sorts):
    """p = 1 in a batch with top-p rows: untouched, and no sort for their sake (their mass never 'reaches' 1
    among the candidates)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4000, generator=g) * 6
    got = apply_top_p(logits, torch.tensor([1.0, 0.8]))
    assert not sorts and torch.equal(got[0], logits[0])
    assert torch.equal(got[1].isfinite(), _sorted_reference(logits[1:], torch.tensor([0.8]))[0].isfinite())


def test_after_top_k_the_candidates_are_the_top_k(sorts):
    """top-k then top-p: the candidates are the k kept tokens, whatever their spread (flat rows too)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50000, generator=g) * 0.1
    top_k = torch.tensor([40, 5, 40, 1])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.9])
    x = apply_top_k(logits, top_k, max_k=40)
    got = apply_top_p(x, top_p, max_k=40)
    assert not sorts
    assert torch.equal(got.isfinite(), _sorted_reference(x, top_p).isfinite())
    assert [int(r.isfinite().sum()) <= k for r, k in zip(got, top_k.tolist(), strict=True)] == [True] * 4
