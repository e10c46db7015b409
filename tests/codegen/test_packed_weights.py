"""The cpu target's GEMM weights held once: model.py packs, when it is built, the weights that only the tvm GEMM
(and a tied embedding's lookup) read, and drops the stored tensors (codegen/render.py `packed_params`,
kernels/tvm.py `pack_weights`); the loader reads CPU weights into memory rather than mapping the files, so a
dropped tensor's pages go too (runtime/artifact.py)."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from kiln.runtime import artifact as artifact_mod
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.memory_plan import profile_batch

pytest.importorskip("tvm")

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1}


def _kernels(model):
    return sys.modules[type(model).__module__].K


def _held_storages(model) -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage the model holds: its attributes (layer lists, packed weights) and
    the module state of its kernel libraries (kernels/tvm.py and kernels/cpu.py: any cache they keep)."""
    K = _kernels(model)
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [vars(model), vars(K), vars(K._ref)]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif isinstance(obj, K.PackedWeight):
            stack.append(obj.panels)
    return storages


def _stored_bytes(manifest: dict) -> int:
    """The artifact's weights, one copy: every tensor the weight files store (an alias stored once)."""
    tensors = manifest["weights"]["tensors"].values()
    return sum(_DTYPE_BYTES[t["dtype"]] * int(torch.tensor(t["shape"]).prod()) for t in tensors)


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2"])
def test_model_holds_each_weight_once(arch, compile_hf, monkeypatch):
    """After a step, the tensors the loaded model holds add up to the weight files' bytes (plus its rotary
    tables), and every stored tensor model.py packed is freed: nothing anywhere in the process references it."""
    _, art, _ = compile_hf(arch)
    originals: dict[str, weakref.ref] = {}
    real = artifact_mod._load_weights

    def recording(*args, **kw):
        weights = real(*args, **kw)
        originals.update({name: weakref.ref(t) for name, t in weights.items()})
        return weights

    monkeypatch.setattr(artifact_mod, "_load_weights", recording)
    loaded = load_artifact(art, load_tokenizer=False)
    kv = loaded.kv_cache_config  # one step first: a kernel library caching anything on first use would show
    batch = profile_batch([5, 1], kv.block_size, torch.device("cpu"), vocab_size=64)
    caches = [torch.zeros((batch.block_tables.numel(), *kv.shape), dtype=kv.dtype) for _ in range(kv.num_layers)]
    assert loaded.model.forward(batch, caches).isfinite().all()
    del batch, caches
    gc.collect()
    module = sys.modules[type(loaded.model).__module__]
    packed, PackedWeight = module.PACKED_WEIGHTS, module.K.PackedWeight
    assert packed <= set(originals)
    held = _held_storages(loaded.model)
    rope = sum(t.untyped_storage().nbytes() for name, t in vars(loaded.model).items() if name.startswith("rope_cache"))
    plan = sum(t.untyped_storage().nbytes() for t in module.K._plan if isinstance(t, torch.Tensor))  # the step's work items
    assert sum(held.values()) == _stored_bytes(loaded.manifest) + rope + plan
    for name, ref in originals.items():
        assert (ref() is None) == (name in packed), name  # packed: the stored tensor is gone; else: it is held
    held_weights = [w for v in vars(loaded.model).values() for w in (v if isinstance(v, list) else [v])]
    assert sum(isinstance(w, PackedWeight) for w in held_weights) >= 4 * 2  # qkv, o, gate/up, down per layer
    if arch == "llama_tied":  # the table the embedding and the LM head share is held once, packed
        assert "embed" in packed and isinstance(loaded.model.embed, PackedWeight)
    if arch == "llama":  # an untied table is read only by the lookup: kept as stored; its LM head packed
        assert "embed" not in packed and "lm_head" in packed


def test_packed_artifact_matches_hf(compile_hf, check_hf_parity):
    """The tied-embedding model, every GEMM on packed weights and its lookups gathered from the packed table:
    fp32 logprobs within 1e-4 of HF and greedy tokens identical."""
    ckpt, art, _ = compile_hf("llama_tied")
    loaded = load_artifact(art, load_tokenizer=False)
    assert isinstance(loaded.model.embed, _kernels(loaded.model).PackedWeight)
    check_hf_parity(art, ckpt, vocab=512)


def test_model_py_names_only_weights_that_gemms_alone_read(compile_hf):
    """PACKED_WEIGHTS: the projections of every layer; norms (read by the norm kernels) never; an untied
    embedding table never (a lookup alone)."""
    _, art, _ = compile_hf("llama")
    source = (art / "model.py").read_text()
    assert "K.pack_weights(weights, PACKED_WEIGHTS)" in source
    start = source.index("PACKED_WEIGHTS = frozenset((")
    block = source[start:source.index("\n))", start)]
    assert '"lm_head"' in block and "norm" not in block and '"embed"' not in block
    assert 'for i in range(2)' in block


def test_resident_memory_after_load_is_one_copy_of_the_weights(tiny_checkpoint, compile_hf, tmp_path):
    """In a fresh process: the resident set grows by about one copy of the weights when the artifact loads (not
    two: neither a packed weight's stored tensor nor its pages in a file mapping survive the load). A tiny
    artifact loads first, so the libraries and modules every load maps are resident before the measurement."""
    import kiln
    from kiln.cli import main

    ckpt = tiny_checkpoint("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2)
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    kiln.compile(recipe, tmp_path / "art", progress=False)
    manifest = json.loads((tmp_path / "art/manifest.json").read_text())
    weight_bytes = _stored_bytes(manifest)
    assert weight_bytes > 60 * 2**20
    script = textwrap.dedent(f"""
        import gc, sys, torch
        from kiln.runtime.artifact import load_artifact

        def rss():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

        warm = load_artifact({str(compile_hf("llama")[1])!r}, load_tokenizer=False)
        gc.collect()
        before = rss()
        loaded = load_artifact({str(tmp_path / "art")!r}, load_tokenizer=False)
        gc.collect()
        module = sys.modules[type(loaded.model).__module__]
        print(rss() - before, module.K.LIBRARY is not None, len(module.PACKED_WEIGHTS))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown, library, packed = out.stdout.split()
    assert library == "True" and int(packed) > 0
    assert 0.9 * weight_bytes < int(grown) < 1.25 * weight_bytes, (int(grown), weight_bytes)
