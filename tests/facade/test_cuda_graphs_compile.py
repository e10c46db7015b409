"""`cuda_graphs { batch_sizes = [...] }`: planned into GPU artifacts' manifests, refused on cpu and when invalid."""
from __future__ import annotations

import json

import pytest

from kiln.cli import main


@pytest.fixture(scope="module")
def recipe(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("llama")
    path = tmp_path_factory.mktemp("recipe") / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(path)]) == 0
    return path


def _with(recipe, tmp_path, section: str):
    p = tmp_path / "g.dsl"
    p.write_text(recipe.read_text().replace("  serve ", f"  {section}\n  serve ", 1))
    return p


def test_gpu_artifact_carries_the_plan(recipe, tmp_path):
    p = _with(recipe, tmp_path, "cuda_graphs { batch_sizes = [4, 1, 2] }")
    assert main(["compile", str(p), "--target", "h200", "-o", str(tmp_path / "o"), "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    plan = manifest["cuda_graphs"]
    assert plan["batch_sizes"] == [1, 2, 4]
    max_len, block = manifest["runtime"]["max_model_len"], manifest["kv_cache"]["block_size"]
    assert plan["max_blocks_per_seq"] == -(-max_len // block)
    assert plan["static_buffers"]["block_tables"]["shape"] == [4, plan["max_blocks_per_seq"]]
    assert plan["estimated_bytes"] > 0
    assert [r["name"] for r in manifest["passes"]][-1] == "cuda_graph_plan"


def test_defaults_on_gpu_none_on_cpu(recipe, tmp_path):
    assert main(["compile", str(recipe), "--target", "h100", "-o", str(tmp_path / "g"), "--no-progress"]) == 0
    plan = json.loads((tmp_path / "g" / "manifest.json").read_text())["cuda_graphs"]
    assert plan["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert main(["compile", str(recipe), "-o", str(tmp_path / "c"), "--no-progress"]) == 0
    assert "cuda_graphs" not in json.loads((tmp_path / "c" / "manifest.json").read_text())


@pytest.mark.parametrize("section, target, needle", [
    ("cuda_graphs { batch_sizes = [1, 2] }", "cpu", "cuda_graphs needs a GPU target"),
    ("cuda_graphs { batch_sizes = [1, 2, 2] }", "h200", "batch size 2 is listed twice"),
    ("cuda_graphs { batch_sizes = [1, 1024] }", "h200", "exceeds scheduler.max_seqs"),
])
def test_refused_at_their_location(recipe, tmp_path, capsys, section, target, needle):
    p = _with(recipe, tmp_path, section)
    assert main(["compile", str(p), "--target", target, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    line = next(i for i, ln in enumerate(p.read_text().splitlines(), 1) if "cuda_graphs" in ln)
    assert err.startswith(f"{p}:{line}:") and needle in err, err
    assert not (tmp_path / "o").exists()


def test_cpu_device_never_captures(recipe, tmp_path, monkeypatch):
    from kiln.runtime import LLMEngine

    assert main(["compile", str(recipe), "--target", "h200", "-o", str(tmp_path / "g"), "--no-progress"]) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # how a GPU artifact loads on a CPU machine
    engine = LLMEngine(tmp_path / "g", num_kv_blocks=8)
    assert engine.artifact.cuda_graph_config.batch_sizes[-1] == 256
    assert engine.runner.graph_runner is None and len(engine.runner.kv_caches[0]) == 8
