"""Compiled artifacts are byte-identical to the recorded ones: a refactor of the compiler (options, targets,
pass registration, KV layout, rewrite engine) must not change what it writes.

Each case compiles a recipe covering one path (the example on cpu and h200, every model family, quantized
weights and KV, AWQ, MLA with and without fp8 KV, an MTP draft head, CUDA-graph buckets, scheduler and KV
options) and compares the sha256 of every artifact file with `artifact_digests.json`. A change that is
meant to change artifacts re-records them, and the diff of that file shows which files changed:

    KILN_RECORD_DIGESTS=1 TRITON_INTERPRET=1 python -m pytest tests/compiler/test_artifact_digests.py
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

import kiln
from kiln.cli import main

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "tests" / "compiler" / "artifact_digests.json"

# case -> (checkpoint arch | "example" | "random", target, (old, new) edits of the recipe)
CASES: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "example_cpu": ("example", "cpu", ()),
    "example_h200": ("example", "h200", ()),
    "llama_cpu": ("llama", "cpu", ()),
    "llama3_rope_cpu": ("llama3_rope", "cpu", ()),
    "mistral_cpu": ("mistral", "cpu", ()),
    "qwen2_h100_graphs": ("qwen2", "h100", (("  serve ", "  cuda_graphs { batch_sizes = [1, 2, 4] }\n  serve "),)),
    "qwen3_cpu_fp8": ("qwen3", "cpu", (("  serve ", "  quantize  { weights = fp8(per_channel=true) }\n  serve "),)),
    "llama_h200_fp8_block_kv": ("llama", "h200", (
        ("dtype   = fp32", "dtype   = bf16"),
        ("  serve ", "  quantize  { weights = fp8(block=32); kv_cache = fp8 }\n  serve "))),
    "mixtral_cpu": ("mixtral", "cpu", ()),
    "qwen3_moe_cpu": ("qwen3_moe", "cpu", ()),
    "deepseek_v3_cpu": ("deepseek_v3", "cpu", ()),
    "deepseek_v2_h200_fp8_kv": ("deepseek_v2", "h200", (("  serve ", "  quantize  { kv_cache = fp8 }\n  serve "),)),
    "deepseek_v3_mtp_cpu": ("deepseek_v3+mtp", "cpu", (("  serve ", "  speculative { method = mtp }\n  serve "),)),
    "llama_awq_cpu": ("llama+awq", "cpu", (("  serve ", "  quantize  { weights = awq(group=128) }\n  serve "),)),
    "random_options": ("random", "cpu", ()),
}

RANDOM_RECIPE = """
recipe options {
  model   = llama(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_position=256, tie_embeddings=true)
  weights = random(seed=3)
  target  = cpu
  dtype   = fp32
  kv_cache  { block_size = 32; num_blocks = 64; memory_fraction = 0.5 }
  scheduler { max_seqs = 8; max_batched_tokens = 512; chunked_prefill = 64; policy = priority; prefix_cache = none;
              preemption = swap; swap_space = 1GiB; async_scheduling = false }
  passes    { disable = [fuse_add_rms_norm] }
  serve     { port = 8100; host = "0.0.0.0"; served_name = "opts"; max_model_len = 128 }
}
"""


# The TVM kernel library is linked by the host's C toolchain: its bytes are checked for reproducibility on one
# host by tests/codegen/test_tvm_build.py; here its TVMScript source and build record stand for it.
HOST_BUILT = {"kernels/tvm_cpu/cpu.so"}


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.relative_to(root).as_posix() not in HOST_BUILT}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkpoint(kind: str, tiny_checkpoint, work: Path) -> Path:
    """The case's checkpoint at `work/ckpt`: the recipe names it by a relative path, which must not depend on
    where the session's fixtures put the original."""
    out = work / "ckpt"
    if kind == "llama+awq":
        quant = _load(REPO / "tests" / "quant" / "quant_testlib.py", "kiln_digest_quant_testlib")
        return quant.awq_checkpoint(tiny_checkpoint("llama", hidden_size=128, intermediate_size=256), out)
    shutil.copytree(tiny_checkpoint(kind.removesuffix("+mtp")), out)
    if kind.endswith("+mtp"):
        _load(REPO / "tests" / "mtp" / "mtp_testlib.py", "kiln_digest_mtp_testlib").add_mtp_layer(out, copies=True)
    return out


def _compile(case: str, tiny_checkpoint, work: Path) -> Path:
    kind, target, edits = CASES[case]
    if kind == "example":
        recipe = REPO / "examples" / "embedded.dsl"
    elif kind == "random":
        recipe = work / "options.dsl"
        recipe.write_text(RANDOM_RECIPE)
    else:
        ckpt = _checkpoint(kind, tiny_checkpoint, work)
        recipe = work / f"{case}.dsl"
        assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe), "--name", case]) == 0  # hf:./ckpt
        text = recipe.read_text().replace("target  = cpu", f"target  = {target}")
        for old, new in edits:
            assert old in text, f"{case}: edit {old!r} does not apply"
            text = text.replace(old, new, 1)
        recipe.write_text(text)
    kiln.compile(recipe, work / "art", target=target if kind == "example" else None, progress=False)
    return work / "art"


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict[str, str]]:
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {}


@pytest.mark.parametrize("case", sorted(CASES))
def test_artifact_bytes_are_as_recorded(case, tiny_checkpoint, tmp_path, recorded, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("KILN_TVM_ISA", "x86-64-v3")  # the kernel library's ISA, not the compiling host's
    art = _compile(case, tiny_checkpoint, tmp_path)
    from kiln.runtime.manifest import validate_manifest

    validate_manifest(json.loads((art / "manifest.json").read_text()))  # codegen's manifest, the runtime's schema
    got = _digests(art)
    if os.environ.get("KILN_RECORD_DIGESTS") == "1":
        data = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        data[case] = got
        RECORD.write_text(json.dumps(dict(sorted(data.items())), indent=1, sort_keys=True) + "\n")
        return
    assert case in recorded, f"no recorded digests for {case}: record them (see the module docstring)"
    want = recorded[case]
    changed = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    assert not changed, f"{case}: these artifact files differ from the recorded ones: {changed}"
