"""vocab_parallel_sampling (passes/vocab_parallel_sampling.py) and its `gather_logits` kernel: the IR before and
after, the kernel on a 3-rank thread mesh against the whole logits (greedy and top-k candidates, a padded
vocabulary whose padding would win if it were not masked, ties across ranks, the fallbacks), and a TP=2
artifact whose greedy and seeded top-k tokens are the same through the candidates as through the full gather
(and the single device's), while the ranks exchange only (value, index) pairs."""
from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest
import torch
from kiln.codegen.render import template_env
from kiln.passes.vocab_parallel_sampling import VocabParallelSampling
from kiln.runtime.worker.distributed.comm import ThreadComm, ThreadMesh

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
from pass_testlib import assert_programs_equal, run_pass, typed  # noqa: E402

BEFORE = """
program p dtype=f32 {
  config {}
  param head: f32[9, 8] from ["lm_head.weight"] {sharding={"placement": "S0[9x1/10]"}}
  graph entry {
    %h = input "h" {placement="R"} : f32[T, 8]
    %head = param "head" {placement="S0[9x1/10]"} : f32[9, 8]
    %l = logits(%h, %head) {placement="S1[9x1/10]"}
    %g = all_gather(%l) {dim=1, placement="R"}
    return %g
  }
}
"""

# the LM head's gather of its vocabulary shards becomes gather_logits (full logits, or each row's top candidates)
AFTER = """
program p dtype=f32 {
  config {}
  param head: f32[9, 8] from ["lm_head.weight"] {sharding={"placement": "S0[9x1/10]"}}
  graph entry {
    %h = input "h" {placement="R"} : f32[T, 8]
    %head = param "head" {placement="S0[9x1/10]"} : f32[9, 8]
    %l = logits(%h, %head) {placement="S1[9x1/10]"}
    %g = gather_logits(%l) {dim=1, placement="R"}
    return %g
  }
}
"""


def placed(text: str):
    program = typed(text)
    return dataclasses.replace(program, meta={**program.meta, "parallel": {"tp": 2}})


def test_before_after_the_lm_head_gather_becomes_gather_logits():
    out, ctx = run_pass(VocabParallelSampling(), placed(BEFORE))
    assert_programs_equal(out, placed(AFTER))
    assert ctx.stats["by_rewrite"] == {"gather_logits": 1}


def test_other_gathers_and_single_device_programs_are_unchanged():
    other = BEFORE.replace("%l = logits(%h, %head)", "%l = linear(%h, %head)")
    program = placed(other)
    out, _ = run_pass(VocabParallelSampling(), program)
    assert out is program


def test_a_tensor_parallel_artifact_samples_from_shards(tmp_path):
    recipe = tmp_path / "r.dsl"
    recipe.write_text("""recipe r {
  model   = llama(vocab=61, hidden=64, layers=1, heads=4, kv_heads=2, ffn=48)
  weights = random(seed=0)
  target  = cpu
  dtype   = fp32
  parallel { tp = 2 }
}
""")
    entry = kiln.compile(recipe).program.graphs["entry"]
    ops = [n.op for _, n in entry.items()]
    assert "gather_logits" in ops and "all_gather" not in ops
    (g,) = [n for _, n in entry.items() if n.op == "gather_logits"]
    assert g.attrs["kernel"] == "cpu.gather_logits" and g.out.shape == ("T", 61)


# ---------------------------------------------------------------- the kernel


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    import importlib.util

    path = tmp_path_factory.mktemp("gather_logits") / "cpu_kernels.py"
    path.write_text(template_env().get_template("cpu/kernels.py.j2").render(kiln_version="t"))
    spec = importlib.util.spec_from_file_location("kiln_test_gather_logits_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Recording(ThreadComm):
    def __init__(self, mesh, rank, sent):
        super().__init__(mesh, rank)
        self.sent = sent

    def all_gather(self, x, dim):
        self.sent.append((self.rank, tuple(x.shape), x.dtype))
        return super().all_gather(x, dim)


def _on_ranks(K, full: torch.Tensor, ranks: int, candidates: int):
    """Each rank's gather_logits of its columns of `full` (padded with zero columns, as zero weight rows give)."""
    rows, size = full.shape
    cols = -(-size // ranks)
    padded = torch.cat([full, torch.zeros(rows, cols * ranks - size)], dim=1)
    mesh, sent = ThreadMesh(ranks, timeout=10), []
    outs = [None] * ranks

    def run(r):
        outs[r] = K.gather_logits(padded[:, r * cols:(r + 1) * cols].clone(), _Recording(mesh, r, sent), candidates,
                                  size=size)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])  # every rank holds the same result
    return outs[0], sent


def test_greedy_candidates_are_the_argmax_of_the_whole_row(K):
    g = torch.Generator().manual_seed(0)
    full = -1.0 - torch.rand(5, 29, generator=g) * 3  # all < 0: a padded column's 0 would win if it took part
    full[1, 3] = full[1, 20] = 0.5  # a tie across ranks: the lowest index, as torch.max on the whole row
    full[2, 27] = -0.5  # the last real column, on the rank that holds the padding
    out, sent = _on_ranks(K, full, 3, 1)  # 29 -> 30 columns, 10 per rank
    assert out.shape == (5, 29)
    top, arg = full.max(dim=1)
    assert torch.equal(out.max(dim=1).indices, arg) and torch.equal(out.max(dim=1).values, top)
    assert arg[1] == 3 and arg[2] == 27
    assert torch.isinf(out).sum() == 5 * 28  # one candidate per row survives
    assert {s for _, s, _ in sent} == {(5, 2)} and {d for _, _, d in sent} == {torch.float64}  # (value, index) only


def test_top_k_candidates_keep_the_k_largest(K):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(4, 40, generator=g)
    out, sent = _on_ranks(K, full, 2, 4)
    want = full.topk(4, dim=1)
    kept = out.isfinite()
    assert kept.sum(dim=1).tolist() == [4] * 4
    assert torch.equal(out.topk(4, dim=1).indices.sort().values, want.indices.sort().values)
    assert torch.equal(out[kept], full[kept])  # the values are the logits themselves
    assert {s for _, s, _ in sent} == {(4, 8)}


@pytest.mark.parametrize("candidates", [0, 5])
def test_every_logit_when_a_step_needs_them_or_the_pairs_would_not_be_smaller(K, candidates):
    full = torch.randn(3, 19)
    out, sent = _on_ranks(K, full, 2, candidates)  # 10 columns a rank: 5 pairs (10 numbers) are no saving
    assert torch.equal(out, full)
    assert {d for _, _, d in sent} == {torch.float32}


# ---------------------------------------------------------------- an artifact, end to end


def test_tp2_tokens_through_candidates_equal_the_full_gathers(compile_parallel, local_mesh, monkeypatch):
    _, single = compile_parallel("llama", None)
    _, art = compile_parallel("llama", "tp = 2")
    sent: list[torch.dtype] = []
    gather = ThreadComm.all_gather

    def recording(self, x, dim):
        sent.append(x.dtype)
        return gather(self, x, dim)

    monkeypatch.setattr(ThreadComm, "all_gather", recording)
    prompts = [[7, 8, 9, 10, 11], list(range(40, 57))]
    greedy = kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    top_k = kiln.SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=3, ignore_eos=True)
    with kiln.LLM(str(single), num_kv_blocks=64) as llm:
        want_greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    with kiln.LLM(str(art), num_kv_blocks=64) as llm:
        runs = {}
        for name, params in (("greedy", greedy), ("top_k", top_k)):
            sent.clear()
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert torch.float64 in sent  # decode steps exchanged (value, index) pairs
            sent.clear()
            # logprobs need every logit: the same request through the full gather
            full = dataclasses.replace(params, logprobs=1)
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, full)] == runs[name]
            assert torch.float64 not in sent
    assert runs["greedy"] == want_greedy
