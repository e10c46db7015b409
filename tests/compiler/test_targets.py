"""The target registry (compiler/targets.py): one list of targets, what each can build (compiler/support.py
`check_supported`), its kernel libraries and pipeline (issue 18)."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import textwrap

import pytest
from kiln.compiler.targets import TARGETS, get_target, register_target

import kiln
from kiln.cli import main

RECIPE = """
recipe r {
  model   = llama(vocab=96, hidden=32, layers=2, heads=2, ffn=64, max_position=128)
  weights = random(seed=1)
  target  = TARGET
EXTRA
}
"""


def _recipe(tmp_path, target: str = "cpu", extra: str = "", name: str = "r.dsl"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(RECIPE).replace("TARGET", target).replace("EXTRA", extra))
    return p


def test_a_new_target_is_one_registration_plus_its_kernel_table(tmp_path):
    """A cpu-like target whose GEMMs go through another kernel id: `register_target` (compiler/targets.py) and
    `register_kernels` (its table) are all it takes; the DSL, the pipeline, codegen and the runtime follow."""
    from kiln.passes import kernel_selection

    cpu = get_target("cpu")
    table = {op: k for op, k in kernel_selection.kernel_table("cpu").items() if k != kernel_selection.INLINE}
    register_target(dataclasses.replace(cpu, name="cpu_torch", description="cpu, GEMMs as torch.linear"))
    kernel_selection.register_kernels("cpu_torch", {**table, "linear": "torch.linear"})
    try:
        res = kiln.compile(_recipe(tmp_path, "cpu_torch"), tmp_path / "alt", progress=False)
        ref = kiln.compile(_recipe(tmp_path, "cpu", name="ref.dsl"), tmp_path / "ref", progress=False)
        assert res.manifest["target"] == "cpu_torch" and res.manifest["device"] == "cpu"
        assert "torch.linear" in res.manifest["kernels"] and "cpu.linear" not in res.manifest["kernels"]
        params = kiln.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        got = kiln.LLM(str(tmp_path / "alt")).generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids
        want = kiln.LLM(str(tmp_path / "ref")).generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids
        assert got == want
        assert ref.manifest["kernels"] != res.manifest["kernels"]
    finally:
        del TARGETS["cpu_torch"], kernel_selection.KERNEL_TABLES["cpu_torch"]


@pytest.mark.parametrize("extra, needle", [
    ("  lora { max_loras = 2 }; parallel { dp = 2 }", "LoRA with parallel.dp = 2 is not supported"),
    ("  disaggregate { decode = 2 }", "disaggregate.decode = 2: more than one decode core behind one router"),
    ("  kv_cache { offload = cpu(1GiB) }; scheduler { prefix_cache = none }",
     "kv_cache.offload keeps the blocks the prefix cache evicts: it needs scheduler.prefix_cache = radix"),
    ("  kv_cache { offload = cpu(1GiB) }; parallel { dp = 2 }",
     "kv_cache.offload with data-parallel attention (parallel.dp = 2) is not implemented yet"),
    ("  parallel { pp = 2 }", "pipeline parallelism is not implemented"),
    ("  parallel { tp = 16 }", "16 ranks (tp x dp) exceed target cpu's 8 devices"),
    ("  speculative { method = medusa }", "speculative decoding method 'medusa' is not implemented yet"),
    ("  speculative { method = eagle }", 'an EAGLE head `method = eagle; draft = "hf:DIR"`'),
    ("  cuda_graphs { batch_sizes = [1, 2] }", "cuda_graphs needs a GPU target (h100, h200)"),
])
def test_report_only_compiles_refuse_what_artifact_compiles_refuse(tmp_path, capsys, extra, needle):
    """`kiln compile --report` without -o runs the same check_supported checks (compiler/support.py), at the same place."""
    p = _recipe(tmp_path, extra=extra)
    line = next(i for i, ln in enumerate(p.read_text().splitlines(), 1) if ln == extra)
    errors = []
    for argv in (["compile", str(p), "-o", str(tmp_path / "o")], ["compile", str(p), "--report"], ["compile", str(p)]):
        assert main(argv) == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1] == errors[2]
    assert errors[0].startswith(f"{p}:{line}:") and needle in errors[0], errors[0]


def test_targets_declare_what_they_support():
    cpu, h200 = get_target("cpu"), get_target("h200")
    assert (cpu.device, cpu.kernel_modules, cpu.cuda_graphs) == ("cpu", ("tvm", "cpu"), False)
    assert (h200.device, h200.kernel_modules, h200.cuda_graphs) == ("cuda", ("triton", "cpu"), True)
    assert cpu.kv_pool_bytes == 256 * 2**20 and h200.kv_pool_bytes is None  # sized at load from the device
    assert all(t.pipeline == "llm" for t in TARGETS.values())


def _kiln_imports(path) -> set[str]:
    """Every kiln module `path` imports, at the top, inside functions or under TYPE_CHECKING."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("kiln.")}


def test_options_and_targets_import_no_circle():
    """compiler/options.py reads the target registry (the step-budget default); the registry reads no options: the
    checks that need both are compiler/support.py's, which imports the two."""
    compiler = pathlib.Path(__file__).resolve().parents[2] / "compiler"
    assert not _kiln_imports(compiler / "targets.py") & {"kiln.compiler.options", "kiln.compiler.support"}
    assert "kiln.compiler.support" not in _kiln_imports(compiler / "options.py")
    assert {"kiln.compiler.options", "kiln.compiler.targets"} <= _kiln_imports(compiler / "support.py")
