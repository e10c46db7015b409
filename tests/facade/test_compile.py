"""The compile driver end to end: dump-ir, byte-identical artifacts, custom passes, unsupported options."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from kiln.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe(tiny_checkpoint, tmp_path_factory) -> Path:
    ckpt = tiny_checkpoint("qwen2")
    path = tmp_path_factory.mktemp("recipe") / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(path)]) == 0
    return path


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_same_recipe_twice_is_byte_identical(recipe, tmp_path):
    assert main(["compile", str(recipe), "-o", str(tmp_path / "a"), "--no-progress"]) == 0
    assert main(["compile", str(recipe), "-o", str(tmp_path / "b"), "--no-progress"]) == 0
    a, b = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert "model.py" in a and any(k.startswith("weights/") for k in a)
    assert a == b


def test_dump_ir_writes_ir_after_every_pass(recipe, tmp_path):
    from kiln.compiler import parse_program
    from kiln.passes.pipeline import build_pipeline

    assert main(["compile", str(recipe), "--dump-ir", str(tmp_path / "ir")]) == 0
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files[0] == "00_input.ir"
    assert [f.split("_", 1)[1][:-3] for f in files[1:]] == [p.name for p in build_pipeline("cpu")]
    before = parse_program((tmp_path / "ir" / files[0]).read_text())
    after = parse_program((tmp_path / "ir" / files[-1]).read_text())
    assert "decoder.wqkv" in after.params and "decoder.wqkv" not in before.params
    assert after.graphs["decoder"].count("silu_mul") == 1


def test_report_lists_fusions(recipe, capsys):
    assert main(["compile", str(recipe), "--report"]) == 0
    out = capsys.readouterr().out
    assert "fuse_qkv" in out and "tvm.paged_attention" in out and "KV bytes per token" in out


def test_custom_pass_from_python_and_from_recipe(recipe, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    from custom_pass import GemmShapes

    res = kiln.compile(recipe, extra_passes=[("after", "fuse_gate_up", GemmShapes())])
    rec = next(r for r in res.pass_log if r["name"] == "gemm_shapes")
    assert rec["changed"] is False
    cfg = res.program.config
    q_rows = cfg["heads"] * cfg["head_dim"] + 2 * cfg["kv_heads"] * cfg["head_dim"]
    layers = cfg["layers"]
    assert [q_rows, cfg["hidden"], layers] in rec["stats"]["gemms"]  # fused qkv already in place
    assert [2 * cfg["ffn"], cfg["hidden"], layers] in rec["stats"]["gemms"]  # fused gate/up
    assert sum(c for _, _, c in rec["stats"]["gemms"]) == 4 * layers + 1  # qkv o gate_up down + logits

    hooked = tmp_path / "hooked.dsl"
    text = recipe.read_text().replace("  serve ", '  passes { before fuse_qkv: "custom_pass:GemmShapes" }\n  serve ')
    hooked.write_text(text)
    res = kiln.compile(hooked)
    names = [r["name"] for r in res.pass_log]
    assert names.index("gemm_shapes") == names.index("fuse_qkv") - 1
    rec = next(r for r in res.pass_log if r["name"] == "gemm_shapes")
    kv_rows = cfg["kv_heads"] * cfg["head_dim"]
    assert [kv_rows, cfg["hidden"], 2 * layers] in rec["stats"]["gemms"]  # k and v still separate
    assert sum(c for _, _, c in rec["stats"]["gemms"]) == 7 * layers + 1  # q k v o gate up down + logits


def test_disable_pass_in_recipe(recipe, tmp_path):
    p = tmp_path / "d.dsl"
    p.write_text(recipe.read_text().replace("  serve ", '  passes { disable = ["fuse_qkv"] }\n  serve '))
    res = kiln.compile(p)
    assert "fuse_qkv" not in [r["name"] for r in res.pass_log]
    assert "decoder.wq" in res.program.params


@pytest.mark.parametrize("old,new,needle", [
    ("  serve ", "  quantize { weights = int8 }\n  serve ", "unknown weight quantization 'int8'"),
    ("  serve ", "  speculative { method = draft; tokens = 4 }\n  serve ", "a separate draft model is"),
    ("  serve ", "  parallel { pp = 2 }\n  serve ", "pipeline parallelism is not implemented"),
])
def test_unbuildable_options_are_refused_at_their_location(recipe, tmp_path, capsys, old, new, needle):
    p = tmp_path / "u.dsl"
    p.write_text(recipe.read_text().replace(old, new, 1))
    assert main(["compile", str(p), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    marker = new.split("{")[0].strip()
    line = next(i for i, ln in enumerate(p.read_text().splitlines(), 1) if ln.strip().startswith(marker))
    assert err.startswith(f"{p}:{line}:") and needle in err, err
    assert not (tmp_path / "o").exists()


def test_gpu_target_compiles_on_a_cpu_machine_and_is_planned(recipe, tmp_path, capsys):
    assert main(["compile", str(recipe), "--target", "h200", "-o", str(tmp_path / "o"), "--no-progress"]) == 0
    assert (tmp_path / "o" / "kernels" / "triton.py").is_file()
    assert '"target": "h200"' in (tmp_path / "o" / "manifest.json").read_text()
    assert main(["compile", str(recipe), "--target", "h200"]) == 0
    assert "h200" in capsys.readouterr().out


def test_python_artifact_generate_subprocess(recipe, tmp_path):
    art = tmp_path / "art"
    assert main(["compile", str(recipe), "-o", str(art), "--no-progress"]) == 0
    res = subprocess.run([sys.executable, str(art), "generate", "Hello there", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Hello there")


def _with_passes(recipe: Path, tmp_path: Path, body: str, name: str = "p.dsl") -> Path:
    p = tmp_path / name
    p.write_text(recipe.read_text().replace("  serve ", f"  passes {{ {body} }}\n  serve "))
    return p


def _located(err: str, p: Path, needle: str) -> tuple[int, int]:
    """(line, col) of the error, which must be at the `needle` text of the passes section."""
    line = next(i for i, ln in enumerate(p.read_text().splitlines(), 1) if ln.strip().startswith("passes"))
    col = p.read_text().splitlines()[line - 1].index(needle) + 1
    assert err.startswith(f"{p}:{line}:{col}: error:"), err
    return line, col


def test_unknown_anchor_is_located_and_checked_before_the_module_is_imported(recipe, tmp_path, capsys):
    (tmp_path / "loud_pass.py").write_text("import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n")
    p = _with_passes(recipe, tmp_path, 'after fuse_qvk: "loud_pass:Anything"')
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    _located(err, p, "fuse_qvk")
    assert "no pass named 'fuse_qvk'" in err and "did you mean 'fuse_qkv'" in err
    assert not (tmp_path / "loud_pass.ran").exists()  # the module was never imported


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_kiln:Pass", "cannot import module 'no_such_module_kiln'"),
    ("custom_pass_here:Missing", "has no 'Missing'"),
    ("custom_pass_here:NotAPass", "is not a kiln Pass subclass"),
    ("broken_pass_here:P", "importing 'broken_pass_here' failed: ZeroDivisionError"),
])
def test_pass_module_errors_are_located_at_the_spec(recipe, tmp_path, capsys, spec, message):
    (tmp_path / "custom_pass_here.py").write_text("class NotAPass:\n    pass\n")
    (tmp_path / "broken_pass_here.py").write_text("1 / 0\n")
    p = _with_passes(recipe, tmp_path, f'after fuse_qkv: "{spec}"')
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    _located(err, p, f'"{spec}"')
    assert message in err, err


def test_pass_module_resolves_next_to_the_recipe(recipe, tmp_path):
    """No PYTHONPATH: a recipe's pass module is found in the recipe's own directory."""
    example = (REPO / "examples" / "custom_pass.py").read_text()
    (tmp_path / "my_passes.py").write_text(example.replace('"gemm_shapes"', '"gemm_shapes_here"'))
    p = _with_passes(recipe, tmp_path, 'after fuse_gate_up: "my_passes:GemmShapes"')
    res = kiln.compile(p)
    names = [r["name"] for r in res.pass_log]
    assert names[names.index("fuse_gate_up") + 1] == "gemm_shapes_here"


def test_disabling_an_unknown_pass_is_located(recipe, tmp_path, capsys):
    p = _with_passes(recipe, tmp_path, 'disable = [fuse_qkv, fuse_silly]')
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    _located(err, p, "fuse_silly")
    assert "no pass named 'fuse_silly' in the cpu pipeline" in err


def test_a_bad_target_flag_is_a_flag_error(recipe, capsys):
    assert main(["compile", str(recipe), "--target", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --target: unknown target 'tpu'") and "(known: h100, h200, cpu)" in err, err
    assert str(recipe) not in err
