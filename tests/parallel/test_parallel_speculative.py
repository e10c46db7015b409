"""Speculative decoding on a device mesh: n-gram drafts are verify rows that rank 0 schedules like any others,
so a tensor-parallel (TP = 2) and a data-parallel-attention (dp = 2) artifact served by gloo rank workers give
the single-device artifact's plain greedy tokens, with drafts both accepted and rejected; so does a draft model
over a dp = 2 target. A draft head (MTP) under data-parallel attention is refused at its recipe line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kiln.dsl.errors import SourceError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
from spec_testlib import greedy, prompts  # noqa: E402

SERVE_LINE = "  serve     {"  # what tests/parallel/conftest.py's parallel edit anchors on too


def parallel_edit(mesh: str) -> tuple[str, str]:
    return (SERVE_LINE, f"  parallel  {{ {mesh} }}\n{SERVE_LINE}")


SPEC = (SERVE_LINE, f"  speculative {{ method = ngram; tokens = 3 }}\n{SERVE_LINE}")


def _greedy_tokens(art, engine_kw=None):
    from kiln.runtime.engine import LLMEngine

    engine = LLMEngine(art, num_kv_blocks=64, **(engine_kw or {}))
    try:
        for i, prompt in enumerate(prompts()):
            engine.add_request(str(i), prompt, greedy(24))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[str(i)] for i in range(len(done))], engine.stats()
    finally:
        engine.runner.shutdown()


@pytest.mark.parametrize("mesh", ["tp = 2", "dp = 2"])
def test_ngram_on_a_mesh_equals_plain_single_device(compile_hf, mesh):
    _, single, _ = compile_hf("llama")
    _, art, _ = compile_hf("llama", edits=(parallel_edit(mesh), SPEC))
    want, _ = _greedy_tokens(single)
    got, stats = _greedy_tokens(art)
    assert got == want
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_draft_model_on_a_data_parallel_mesh_equals_plain_single_device(compile_hf):
    """The draft model (here the single-device artifact itself, so most drafts are accepted) runs in rank 0's
    process with its own KV pool; the dp = 2 target verifies its drafts."""
    _, single, _ = compile_hf("llama")
    _, art, _ = compile_hf("llama", edits=(parallel_edit("dp = 2"),))
    want, _ = _greedy_tokens(single)
    got, stats = _greedy_tokens(art, {"speculative": "draft", "num_speculative_tokens": 3,
                                      "speculative_model": str(single)})
    assert got == want
    assert stats["spec_acceptance_rate"] > 0.5


def test_draft_head_with_data_parallel_attention_is_refused(compile_hf):
    with pytest.raises(SourceError, match="mtp with data-parallel attention") as e:
        compile_hf("llama", edits=(parallel_edit("dp = 2"), (SERVE_LINE, f"  speculative {{ method = mtp }}\n{SERVE_LINE}")))
    loc = e.value.loc
    assert "speculative" in Path(loc.file).read_text().splitlines()[loc.line - 1]  # at the speculative line
