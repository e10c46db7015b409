"""The scheduler's step budget (scheduler.max_batched_tokens) has one source per target, the target registry
(compiler/targets.py `Target.max_batched_tokens`): a recipe that leaves the key out gets its target's, an explicit
value always wins, and the manifest, `kiln compile --report` and `kiln recipe from-hf` all say the same."""
from __future__ import annotations

import json
import textwrap

import pytest
from kiln.compiler.targets import DEFAULT_STEP_BUDGET, get_target

import kiln
from kiln.cli import main

RECIPE = """
recipe r {
  model   = llama(vocab=96, hidden=32, layers=2, heads=2, ffn=64, max_position=128)
  weights = random(seed=1)
  target  = TARGET
  dtype   = DTYPE
SCHEDULER}
"""


def _recipe(tmp_path, target: str, scheduler: str = "") -> str:
    p = tmp_path / f"{target}.dsl"
    dtype = "fp32" if target == "cpu" else "bf16"
    p.write_text(textwrap.dedent(RECIPE).replace("TARGET", target).replace("DTYPE", dtype)
                 .replace("SCHEDULER", f"  scheduler {{ {scheduler} }}\n" if scheduler else ""))
    return str(p)


def test_the_registry_budgets_a_cpu_step_smaller_than_a_gpu_step():
    """cpu: 2048 (vLLM's CPU server default; a step of 8192 prompt tokens stalls every stream for seconds on a
    2-core host, docs/performance.md); GPU targets: 8192 (vLLM's GPU default with chunked prefill)."""
    assert get_target("cpu").max_batched_tokens == 2048 and get_target("cpu").step_budget_reason
    for gpu in ("h100", "h200"):
        assert get_target(gpu).max_batched_tokens == DEFAULT_STEP_BUDGET == 8192
        assert not get_target(gpu).step_budget_reason


@pytest.mark.parametrize("target, scheduler, want, whose", [
    ("cpu", "", 2048, "the cpu target's default"),
    ("cpu", "max_seqs = 8", 2048, "the cpu target's default"),  # a scheduler section without the key
    ("h200", "", 8192, "the h200 target's default"),
    ("cpu", "max_batched_tokens = 8192", 8192, "the recipe's"),
    ("cpu", "max_batched_tokens = 512", 512, "the recipe's"),
    ("h200", "max_batched_tokens = 2048", 2048, "the recipe's"),
])
def test_the_target_default_applies_where_the_recipe_leaves_the_key_out(tmp_path, target, scheduler, want, whose):
    """The compiled options, the manifest (what the runtime schedules with) and the report agree."""
    res = kiln.compile(_recipe(tmp_path, target, scheduler), tmp_path / "art", progress=False)
    assert res.options.scheduler.max_batched_tokens == want
    assert res.manifest["scheduler"]["max_batched_tokens"] == want
    on_disk = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert on_disk["scheduler"]["max_batched_tokens"] == want
    line = next(x for x in res.report.splitlines() if x.strip().startswith("tokens a step"))
    assert f"{want:,}" in line and whose in line, line


def test_the_target_flag_retargets_the_default(tmp_path, capsys):
    """`kiln compile --target h200` of a cpu recipe without the key: h200's budget, in the report too."""
    assert main(["compile", _recipe(tmp_path, "cpu"), "--target", "h200", "--report"]) == 0
    out = capsys.readouterr().out
    assert "tokens a step          8,192  (the h200 target's default" in out, out


def test_the_runtime_schedules_with_the_resolved_budget(tmp_path):
    """A hand-written cpu recipe without the key: the engine's scheduler takes 2048 tokens a step; the serve-time
    override (`kiln serve --max-num-batched-tokens`, `LLM(max_num_batched_tokens=)`) still wins over it."""
    kiln.compile(_recipe(tmp_path, "cpu"), tmp_path / "art", progress=False)
    with kiln.LLM(str(tmp_path / "art")) as llm:
        assert llm.engine.scheduler.config.max_batched_tokens == 2048
    with kiln.LLM(str(tmp_path / "art"), max_num_batched_tokens=512) as llm:
        assert llm.engine.scheduler.config.max_batched_tokens == 512


@pytest.mark.parametrize("target", ["cpu", "h200"])
def test_from_hf_leaves_the_budget_to_the_target(tiny_checkpoint, tmp_path, target):
    """from-hf writes no step budget of its own: the comment states the registry's, with the registry's reason, and
    the compiled recipe gets the registry's; retargeting the recipe retargets the budget."""
    from kiln.recipe_from_hf import recipe_from_hf

    tgt = get_target(target)
    text = recipe_from_hf(tiny_checkpoint("llama"), target=target)
    assert "max_batched_tokens =" not in text
    comment = " ".join(line.strip().lstrip("# ") for line in text.splitlines() if line.strip().startswith("#"))
    assert f"the target's step budget, {tgt.max_batched_tokens} tokens on {target}" in comment
    assert (tgt.step_budget_reason in comment) if tgt.step_budget_reason else "stalls" not in comment
    path = tmp_path / "r.dsl"
    path.write_text(text)
    res = kiln.compile(path, progress=False)
    assert res.options.scheduler.max_batched_tokens == tgt.max_batched_tokens
    other = "h200" if target == "cpu" else "cpu"
    res = kiln.compile(path, target=other, progress=False)
    assert res.options.scheduler.max_batched_tokens == get_target(other).max_batched_tokens
