"""Speculative decoding on a device mesh: n-gram drafts are verify rows that rank 0 schedules like any others,
so a tensor-parallel (TP = 2) and a data-parallel-attention (dp = 2) artifact served by gloo rank workers give
the single-device artifact's plain greedy tokens, with drafts both accepted and rejected; so does a draft model
over a dp = 2 target. A draft head (MTP) under data-parallel attention is refused at its recipe line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kiln.dsl.errors import SourceError

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
from spec_testlib import greedy, prompts  # noqa: E402

SERVE_LINE = "  serve     {"
SPEC = (SERVE_LINE, f"  speculative {{ method = ngram; tokens = 3 }}\n{SERVE_LINE}")


def _greedy_tokens(art, **engine_kw):
    """Greedy tokens of prompts() and the engine's counters; the rank workers stopped before returning."""
    with kiln.LLM(str(art), num_kv_blocks=64, **engine_kw) as llm:
        outs = llm.generate(prompts(), greedy(24))
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


@pytest.mark.parametrize("mesh", ["tp = 2", "dp = 2"])
def test_ngram_on_a_mesh_equals_plain_single_device(compile_parallel, mesh):
    _, single = compile_parallel("llama", None)
    _, art = compile_parallel("llama", mesh, edits=(SPEC,))
    want, _ = _greedy_tokens(single)
    got, stats = _greedy_tokens(art)
    assert got == want
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_draft_model_on_a_data_parallel_mesh_equals_plain_single_device(compile_parallel):
    """The draft model (here the single-device artifact itself, so most drafts are accepted) runs in rank 0's
    process with its own KV pool; the dp = 2 target verifies its drafts."""
    _, single = compile_parallel("llama", None)
    _, art = compile_parallel("llama", "dp = 2")
    want, _ = _greedy_tokens(single)
    got, stats = _greedy_tokens(art, speculative="draft", num_speculative_tokens=3, speculative_model=str(single))
    assert got == want
    assert stats["spec_acceptance_rate"] > 0.5


def test_draft_head_with_data_parallel_attention_is_refused(compile_parallel):
    with pytest.raises(SourceError, match="mtp with data-parallel attention") as e:
        compile_parallel("llama", "dp = 2", edits=((SERVE_LINE, f"  speculative {{ method = mtp }}\n{SERVE_LINE}"),))
    loc = e.value.loc
    assert "speculative" in Path(loc.file).read_text().splitlines()[loc.line - 1]  # at the speculative line
