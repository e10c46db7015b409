"""kiln eval: sliding windows, perplexity through the CLI, compare of an artifact with itself."""
from __future__ import annotations

import pytest
from quant_testlib import build

from kiln.cli import main
from kiln.eval import ArtifactScorer, compare, perplexity, windows


@pytest.mark.parametrize("n,max_tokens,stride", [(10, 4, 2), (10, 4, 4), (7, 16, 8), (33, 8, 3)])
def test_windows_score_each_position_once_with_context(n, max_tokens, stride):
    scored = []
    for begin, end, first in windows(n, max_tokens, stride):
        assert begin < first < end <= n and end - begin <= max_tokens
        scored += range(first, end)
    assert len(scored) == len(set(scored)) and set(scored) <= set(range(1, n))
    if stride < max_tokens:
        assert set(scored) == set(range(1, n))


def test_eval_cli_and_self_compare(tiny_checkpoint, tmp_path, capsys):
    art = build(tiny_checkpoint("llama"), tmp_path / "art")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert main(["eval", "ppl", str(art), "--text", str(text), "--max-tokens", "64", "--stride", "32"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["eval", "compare", str(art), str(art), "--text", str(text), "--max-tokens", "64"]) == 0
    assert "KL(A || B) mean 0.000000" in capsys.readouterr().out
    s = ArtifactScorer(art, 64)
    ids = s.encode(text.read_text())[:100]
    c = compare(s, s, ids, stride=32)
    assert c.kl == 0.0 and c.top1_agreement == 1.0 and c.a.ppl == perplexity(s, ids, stride=32).ppl


def test_eval_shows_progress_over_the_windows(tiny_checkpoint, tmp_path, capsys):
    """A long text takes many windows: a progress bar on stderr (a terminal by default, forced here)."""
    art = build(tiny_checkpoint("llama"), tmp_path / "art")
    s = ArtifactScorer(art, 16)
    ids = s.encode("the quick brown fox jumps over the lazy dog. " * 8)[:80]
    quiet = perplexity(s, ids, stride=8, progress=False)
    assert capsys.readouterr().err == ""
    shown = perplexity(s, ids, stride=8, progress=True)
    err = capsys.readouterr().err
    assert "scoring" in err and "100%" in err and shown == quiet
