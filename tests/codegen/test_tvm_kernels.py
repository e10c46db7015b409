"""The apache-tvm kernels of the cpu target (codegen/templates/tvm/) against the compiler's op references
(compiler/ops.py), through the artifact's kernel module (kernels/tvm.py) as model.py calls it."""
from __future__ import annotations

import logging
import math
import os
import random
import sys

import pytest
import torch
from kiln.compiler.ops import OPS, ROPE_ATTRS, RefContext
from kiln.runtime import tvm_kernels
from kiln.runtime.forward_batch import ForwardBatch
from tvm_testlib import build_kernel_package, import_kernel_package

pytest.importorskip("tvm")

# (query heads, KV heads, head_dim, block size): GQA groups 1, 2, 4, 8; head_dim 32, 64, 128; blocks 16, 32
SHAPES = [(4, 4, 32, 16), (8, 4, 64, 32), (8, 2, 128, 16), (16, 2, 64, 32), (8, 1, 32, 16), (9, 3, 64, 16)]
# the shapes of real models: Qwen2.5-0.5B (group 7, head_dim 64), Llama-3-8B (group 4, head_dim 128), group 8 x 128
MODEL_SHAPES = [(14, 2, 64, 16), (32, 8, 128, 16), (16, 2, 128, 16)]
# (cached tokens, new tokens), decodes first: contexts crossing block boundaries, a fresh prefill longer than a
# work item, a chunk continuing a cached prefix, a decode at a block's first slot
MIXED = [(15, 1), (16, 1), (32, 1), (40, 1), (0, 37), (17, 20), (31, 2)]
THETA = 10000.0


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    cache: dict[tuple, object] = {}

    def get(heads, kv_heads, head_dim, block_size, dtype="float32"):
        key = (heads, kv_heads, head_dim, block_size, dtype)
        if key not in cache:
            module, record = build_kernel_package(tmp_path_factory.mktemp("tvm"), head_dim=head_dim, num_heads=heads,
                                                  num_kv_heads=kv_heads, block_size=block_size, dtype=dtype)
            assert record["library"] == "cpu.so" and module.LIBRARY is not None, record.get("reason")
            cache[key] = module
        return cache[key]

    return get


def _batch(seqs, heads, kv_heads, head_dim, block_size, dtype, *, rope: bool, seed=0, rope_attrs=None):
    """A paged batch over shuffled physical blocks, the cached prefixes already in the cache (roped when `rope`,
    with `rope_attrs` beside theta), and each sequence's dense q/k/v for the reference."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    num_blocks = len(seqs) * max_blocks + 2
    kv_cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)  # stale contents
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    dense, q_new, k_new, v_new, slots, positions, starts = [], [], [], [], [], [], [0]
    for b, (cached, new) in enumerate(seqs):
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / block_size))]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        q, k, v = (torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        ctx = RefContext(positions=torch.arange(total))
        k_cached = OPS["rope"].reference(ctx, k, **{**ROPE_ATTRS, "theta": THETA, **(rope_attrs or {})}) if rope else k
        for p in range(cached):
            kv_cache[blocks[p // block_size], 0, p % block_size] = k_cached[p]
            kv_cache[blocks[p // block_size], 1, p % block_size] = v[p]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        positions += list(range(cached, total))
        dense.append((ctx, q, k, v, new))
        q_new.append(q[cached:])
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        starts.append(starts[-1] + new)
    batch = ForwardBatch(
        input_ids=torch.zeros(starts[-1], dtype=torch.int32), positions=torch.tensor(positions, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int32),
        num_decodes=sum(1 for c, n in seqs if n == 1 and c > 0))
    return batch, kv_cache, torch.cat(q_new), torch.cat(k_new), torch.cat(v_new), dense


def _reference(dense, scale, window, rope, rope_attrs=None):
    attrs = {"scale": scale, "sliding_window": window,
             **({"rope": {"theta": THETA, **(rope_attrs or {})}} if rope else {})}
    return torch.cat([OPS["attention"].reference(ctx, q, k, v, **attrs)[-new:] for ctx, q, k, v, new in dense])


def _packed_qkv(q, k, v):
    """q, k, v as the views model.py passes: slices of one fused qkv projection, unflattened (strided rows)."""
    t, h, d = q.shape
    qkv = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)
    kvw = k.shape[1] * d
    return (qkv[:, :h * d].unflatten(-1, (h, d)), qkv[:, h * d:h * d + kvw].unflatten(-1, (-1, d)),
            qkv[:, h * d + kvw:].unflatten(-1, (-1, d)))


@pytest.mark.parametrize("parallel_kv_write", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("rope", [False, True], ids=["kv_write", "rope_kv_write"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_paged_attention_matches_op_reference(package, shape, rope, parallel_kv_write, monkeypatch):
    heads, kv_heads, head_dim, block_size = shape
    K = package(*shape)
    # the KV write's two variants: over tokens in parallel (prefill-sized steps) and serial (decode-sized ones)
    monkeypatch.setattr(K, "_PARALLEL_MIN", 0 if parallel_kv_write else 1 << 62)
    batch, kv_cache, q, k, v, dense = _batch(MIXED, heads, kv_heads, head_dim, block_size, torch.float32, rope=rope)
    scale = head_dim ** -0.5
    rope_cache = K.rope_cache(head_dim, 128, THETA) if rope else None
    # fused: q/k arrive un-roped and the kernel ropes them (the reference too); else they count as roped already
    k_stored = k
    if rope:
        k_stored = OPS["rope"].reference(RefContext(positions=batch.positions.long()), k, **{**ROPE_ATTRS, "theta": THETA})
    qp, kp, vp = _packed_qkv(q, k, v)
    out = K.paged_attention(qp, kp, vp, kv_cache, batch, scale, rope_cache=rope_cache)
    ref = _reference(dense, scale, 0, rope)
    assert out.shape == (q.shape[0], heads * head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    slots = batch.slot_mapping
    blocks, offsets = slots // block_size, slots % block_size
    torch.testing.assert_close(kv_cache[blocks, 0, offsets], k_stored, rtol=0, atol=1e-6)
    assert torch.equal(kv_cache[blocks, 1, offsets], v)


@pytest.mark.parametrize("window", [1, 5, 16, 24])
def test_paged_attention_sliding_window(package, window):
    shape = (8, 2, 64, 16)
    K = package(*shape)
    batch, kv_cache, q, k, v, dense = _batch(MIXED, *shape, torch.float32, rope=False, seed=2)
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125, sliding_window=window)
    torch.testing.assert_close(out, _reference(dense, 0.125, window, False), rtol=0, atol=2e-5)
    full = K.paged_attention(q, k, v, kv_cache, batch, 0.125)
    assert not torch.allclose(out, full)  # the window really cut context


@pytest.mark.parametrize("window", [0, 11])
def test_paged_attention_blocks_narrower_than_a_vector(package, window):
    """KV blocks of 8 keys: on an AVX-512 build (16 lanes) decodes take the prefill tile's path (the decode path
    sums a whole vector of keys at once), on an AVX2 build (8 lanes) the decode path with one key vector a block."""
    shape = (8, 2, 32, 8)
    K = package(*shape)
    seqs = [(7, 1), (8, 1), (29, 1), (0, 1), (0, 19), (13, 6)]
    batch, kv_cache, q, k, v, dense = _batch(seqs, *shape, torch.float32, rope=False, seed=6)
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125, sliding_window=window)
    torch.testing.assert_close(out, _reference(dense, 0.125, window, False), rtol=0, atol=2e-5)


def test_paged_attention_decode_only_and_large_batch(package):
    shape = (9, 3, 64, 16)
    K = package(*shape)
    seqs = [(random.Random(b).randrange(1, 90), 1) for b in range(24)]
    batch, kv_cache, q, k, v, dense = _batch(seqs, *shape, torch.float32, rope=False, seed=3)
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125)
    torch.testing.assert_close(out, _reference(dense, 0.125, 0, False), rtol=0, atol=2e-5)
    # work items are cached per step: a second call with other query_start_loc values must not reuse them
    batch2, kv2, q2, k2, v2, dense2 = _batch([(5, 3), (0, 1), (20, 9)], *shape, torch.float32, rope=False, seed=4)
    out2 = K.paged_attention(q2, k2, v2, kv2, batch2, 0.125)
    torch.testing.assert_close(out2, _reference(dense2, 0.125, 0, False), rtol=0, atol=2e-5)


def test_paged_attention_bf16(package):
    shape = (8, 2, 64, 16)
    K = package(*shape, dtype="bfloat16")
    batch, kv_cache, q, k, v, dense = _batch(MIXED, *shape, torch.bfloat16, rope=True, seed=5)
    rope_cache = K.rope_cache(64, 128, THETA)
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125, rope_cache=rope_cache)
    assert out.dtype == torch.bfloat16
    ref = _reference([(c, dq.float(), dk.float(), dv.float(), n) for c, dq, dk, dv, n in dense], 0.125, 0, True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    # the torch kernel on the same bf16 inputs lands as close
    torch_out = K._ref.paged_attention(q, k, v, kv_cache.clone(), batch, 0.125, rope_cache=rope_cache)
    torch.testing.assert_close(out.float(), torch_out.float(), rtol=2e-2, atol=2e-2)


# decodes, then prefill chunks (fresh, and continuing a cached prefix) whose last work item has one token, so
# single-token items come from both and sit among longer ones in query_start_loc order
MODEL_MIXED = [(15, 1), (0, 37), (40, 1), (17, 21), (31, 2), (16, 1), (9, 33)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_paged_attention_at_model_shapes(package, shape, dtype):
    """GQA groups up to 8 with head_dim up to 128 (the decode loop's per-row scratch) in fp32 and bf16 (a bf16
    artifact's KV cache): decodes and chunked prefills with cached prefixes against the op reference. bf16
    inputs are exact in fp32, so the reference runs on them in fp32 and the kernel's output is that, rounded once
    to bf16 (within a bf16 ulp: 2**-7 relative). Single-token work items (decodes, and prefill chunks' last
    tokens) run the kernel's decode loop, longer ones its prefill tiles."""
    heads, kv_heads, head_dim, block_size = shape
    K = package(*shape, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    rope = dtype == "float32"  # bf16: q/k as given, so the reference sees the very bf16 values the kernel reads
    batch, kv_cache, q, k, v, dense = _batch(MODEL_MIXED, *shape, torch_dtype, rope=rope, seed=7)
    scale = head_dim ** -0.5
    rope_cache = K.rope_cache(head_dim, 128, THETA) if rope else None
    out = K.paged_attention(*_packed_qkv(q, k, v), kv_cache, batch, scale, rope_cache=rope_cache)
    assert out.dtype == torch_dtype and out.shape == (q.shape[0], heads * head_dim)
    work, num_decode_items = K._work_items(batch.query_start_loc)
    assert num_decode_items > len([s for s in MODEL_MIXED if s[1] == 1])  # prefill chunks ended in single tokens
    assert bool((work[:num_decode_items, 2] == 1).all()) and bool((work[num_decode_items:, 2] > 1).all())
    if dtype == "float32":
        torch.testing.assert_close(out, _reference(dense, scale, 0, True), rtol=0, atol=2e-5)
    else:
        ref = _reference([(c, dq.float(), dk.float(), dv.float(), n) for c, dq, dk, dv, n in dense], scale, 0, False)
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("shape", MODEL_SHAPES[:2], ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_paged_attention_at_model_shapes_with_a_window(package, shape):
    K = package(*shape)
    batch, kv_cache, q, k, v, dense = _batch(MODEL_MIXED, *shape, torch.float32, rope=False, seed=8)
    scale = shape[2] ** -0.5
    out = K.paged_attention(q, k, v, kv_cache, batch, scale, sliding_window=19)
    torch.testing.assert_close(out, _reference(dense, scale, 19, False), rtol=0, atol=2e-5)


def test_partial_rotary_ropes_in_torch_then_writes_and_attends_in_the_library(package, monkeypatch):
    """Phi-4-mini rotates 3/4 of each head: rope_kv_write rotates whole heads, so q and k rotate in torch (the
    library's `rope` is the torch one), and the library's KV write and attention still run (never the torch
    attention)."""
    shape = (4, 4, 32, 16)
    K = package(*shape)
    monkeypatch.setattr(K._ref, "paged_attention", lambda *a, **kw: pytest.fail("the torch attention ran"))
    partial = {"rotary_dim": 24}
    batch, kv_cache, q, k, v, dense = _batch(MIXED, *shape, torch.float32, rope=True, seed=6, rope_attrs=partial)
    out = K.paged_attention(*_packed_qkv(q, k, v), kv_cache, batch, 0.125,
                            rope_cache=K.rope_cache(32, 128, THETA, rotary_dim=24))
    torch.testing.assert_close(out, _reference(dense, 0.125, 0, True, partial), rtol=0, atol=2e-5)
    slots = batch.slot_mapping
    k_stored = OPS["rope"].reference(RefContext(positions=batch.positions.long()), k,
                                     **{**ROPE_ATTRS, "theta": THETA, **partial})
    torch.testing.assert_close(kv_cache[slots // 16, 0, slots % 16], k_stored, rtol=0, atol=1e-6)
    assert torch.equal(k_stored[..., 24:], k[..., 24:])


def test_unsupported_calls_run_the_torch_kernel(package, monkeypatch):
    """fp8 KV scales, or a shape other than the rendered one, go to kernels/cpu.py (same results)."""
    K = package(8, 2, 64, 16)
    calls = []
    real = K._ref.paged_attention
    monkeypatch.setattr(K._ref, "paged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    batch, kv_cache, q, k, v, dense = _batch(MIXED, 4, 2, 64, 16, torch.float32, rope=False)  # 4 heads, not 8
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125)
    assert calls == [1]
    torch.testing.assert_close(out, _reference(dense, 0.125, 0, False), rtol=0, atol=2e-5)
    assert K.silu is K._ref.silu  # kernels the library has none of: the torch ones


def test_attention_with_sinks_runs_the_torch_kernel(package, monkeypatch):
    """gpt-oss's per-head sink logits: the TVM attention has no sink term, so the call goes to kernels/cpu.py,
    which adds it (different from the same call without sinks)."""
    K = package(8, 2, 64, 16)
    calls = []
    real = K._ref.paged_attention
    monkeypatch.setattr(K._ref, "paged_attention", lambda *a, **kw: calls.append(kw.get("sinks")) or real(*a, **kw))
    batch, kv_cache, q, k, v, dense = _batch(MIXED, 8, 2, 64, 16, torch.float32, rope=False)
    sinks = torch.linspace(-1.0, 3.0, 8)
    plain = K.paged_attention(q, k, v, kv_cache.clone(), batch, 0.125)
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125, sinks=sinks)
    assert len(calls) == 1 and calls[0] is sinks
    assert not torch.allclose(out, plain, atol=1e-3)


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kiln.runtime.tvm_kernels"]


def test_library_for_another_cpu_falls_back_with_one_log_line(tmp_path, monkeypatch, caplog):
    build_kernel_package(tmp_path, head_dim=32, num_heads=4, num_kv_heads=2, block_size=16)
    monkeypatch.setattr(tvm_kernels, "_loaded", {})
    monkeypatch.setattr(tvm_kernels, "_cpu_flags", lambda: frozenset({"sse2"}))
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.tvm_kernels"):
        K = import_kernel_package(tmp_path / "kernels")
    assert K.LIBRARY is None
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and "this CPU lacks" in lines[0] and "avx2" in lines[0] and "torch kernels" in lines[0]
    batch, kv_cache, q, k, v, dense = _batch(MIXED, 4, 2, 32, 16, torch.float32, rope=False)
    torch.testing.assert_close(K.paged_attention(q, k, v, kv_cache, batch, 32 ** -0.5),
                               _reference(dense, 32 ** -0.5, 0, False), rtol=0, atol=2e-5)


def test_without_apache_tvm_the_artifact_runs_torch_kernels(tmp_path, monkeypatch, caplog):
    """A serving host without apache-tvm (libtvm_runtime.so) loads no library: one log line, torch kernels."""
    build_kernel_package(tmp_path, head_dim=32, num_heads=4, num_kv_heads=2, block_size=16)

    def missing():
        raise ImportError("apache-tvm is not installed")

    monkeypatch.setattr(tvm_kernels, "_loaded", {})
    monkeypatch.setattr(tvm_kernels, "_runtime_library", missing)
    monkeypatch.delitem(sys.modules, "tvm")  # as on a host that never imported the compiler
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.tvm_kernels"):
        K = import_kernel_package(tmp_path / "kernels")
    assert K.LIBRARY is None
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and "apache-tvm is not installed" in lines[0]


def test_no_library_built_is_said_once_at_load(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KILN_TVM_ISA", "none")  # as on a compiling host below x86-64-v3
    K, record = build_kernel_package(tmp_path, head_dim=32, num_heads=4, num_kv_heads=2, block_size=16)
    assert record["library"] is None and record["reason"] == "KILN_TVM_ISA=none"
    assert not (tmp_path / "kernels/tvm_cpu/cpu.so").exists() and K.LIBRARY is None
    assert any("has no TVM library" in line for line in _fallback_lines(caplog))


# (rows, width): widths off the vector length, and steps on both sides of the serial/parallel switch
ROWS = [(7, 256), (3, 576), (5, 64), (4, 37), (130, 576), (300, 259)]


@pytest.mark.parametrize("rows,width", ROWS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_rms_norm_matches_op_reference(package, rows, width, dtype):
    K = package(8, 2, 64, 16, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(width)
    x, r = (torch.randn(rows, width, generator=g).to(torch_dtype) for _ in range(2))
    w = (torch.randn(width, generator=g) * 0.5 + 1).to(torch_dtype)
    ctx = RefContext(positions=torch.arange(rows))
    ref_normed, ref_summed = OPS["add_rms_norm"].reference(ctx, x, r, w, eps=1e-5)
    normed, summed = K.add_rms_norm(x, r, w, 1e-5)
    assert K.LIBRARY is not None and normed.dtype == torch_dtype
    assert torch.equal(summed, ref_summed)
    tol = 1e-6 if dtype == "float32" else 2e-2
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,width", ROWS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_matches_op_reference(package, rows, width, dtype, monkeypatch):
    K = package(8, 2, 64, 16, dtype=dtype)
    monkeypatch.setattr(K._ref, "rms_norm", None)  # the TVM kernel, never the torch fallback
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(width + 1)
    x = (torch.randn(rows, width + 3, generator=g) * 3).to(torch_dtype)[:, 1:1 + width]  # rows strided
    w = (torch.randn(width, generator=g) * 0.5 + 1).to(torch_dtype)
    ref = OPS["rms_norm"].reference(RefContext(positions=torch.arange(rows)), x, w, eps=1e-5)
    out = K.rms_norm(x, w, 1e-5)
    assert out.dtype == torch_dtype and out.shape == x.shape
    tol = 1e-6 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_rms_norm_per_head_and_fallbacks(package):
    """q/k norm over [T, heads, head_dim] with a [head_dim] weight; another dtype runs the torch kernel."""
    K = package(8, 2, 64, 16)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 8 * 64 + 64, generator=g)[:, :8 * 64].unflatten(-1, (8, 64))  # a slice of a fused projection
    w = torch.randn(64, generator=g)
    ref = OPS["rms_norm"].reference(RefContext(positions=torch.arange(6)), q, w, eps=1e-6)
    torch.testing.assert_close(K.rms_norm(q, w, 1e-6), ref, rtol=1e-6, atol=1e-6)
    q64, w64 = q.double(), w.double()
    torch.testing.assert_close(K.rms_norm(q64, w64, 1e-6), K._ref.rms_norm(q64, w64, 1e-6))


@pytest.mark.parametrize("rows,width", ROWS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_silu_mul_matches_op_reference(package, rows, width, dtype):
    K = package(8, 2, 64, 16, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    gate_up = (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)) * 4).to(torch_dtype)
    ref = OPS["silu_mul"].reference(RefContext(positions=torch.arange(rows)), gate_up)
    out = K.silu_mul(gate_up)
    assert K.LIBRARY is not None and out.dtype == torch_dtype and out.shape == (rows, width)
    tol = 2e-6 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_a_library_recompiled_in_place_is_the_one_loaded(tmp_path):
    """Another shape compiled into the same folder in one process: the new library runs, not the mapped one."""
    first, _ = build_kernel_package(tmp_path / "a", head_dim=32, num_heads=4, num_kv_heads=2, block_size=16)
    import shutil

    shutil.rmtree(tmp_path / "a")
    K, _ = build_kernel_package(tmp_path / "a", head_dim=64, num_heads=8, num_kv_heads=2, block_size=16)
    assert K.LIBRARY is not first.LIBRARY and K.LIBRARY.params["head_dim"] == 64
    batch, kv_cache, q, k, v, dense = _batch(MIXED, 8, 2, 64, 16, torch.float32, rope=False)
    torch.testing.assert_close(K.paged_attention(q, k, v, kv_cache, batch, 0.125),
                               _reference(dense, 0.125, 0, False), rtol=0, atol=2e-5)


def test_index_tensors_outside_the_contract_run_the_torch_kernel(package):
    """int64 positions (not the ForwardBatch contract's int32) reach the torch kernel, not a TVM dtype error."""
    K = package(8, 2, 64, 16)
    batch, kv_cache, q, k, v, dense = _batch(MIXED, 8, 2, 64, 16, torch.float32, rope=True)
    batch.positions = batch.positions.long()
    out = K.paged_attention(q, k, v, kv_cache, batch, 0.125, rope_cache=K.rope_cache(64, 128, THETA))
    torch.testing.assert_close(out, _reference(dense, 0.125, 0, True), rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def gemm(tmp_path_factory):
    """A kernel package holding only the GEMM (`tvm.linear`), per dtype."""
    cache: dict[str, object] = {}

    def get(dtype):
        if dtype not in cache:
            # bf16: the TVM kernel under test, also on a CPU with native bf16 (where the library leaves bf16 GEMMs
            # to oneDNN: tests of that choice are test_bf16_gemm_*); the process's cached choice is restored after
            saved_env, saved_choice = os.environ.get(tvm_kernels.BF16_GEMM_ENV), list(tvm_kernels._bf16_choice)
            os.environ[tvm_kernels.BF16_GEMM_ENV] = "tvm"
            tvm_kernels._bf16_choice.clear()
            try:
                module, record = build_kernel_package(tmp_path_factory.mktemp("gemm"), head_dim=64, num_heads=8,
                                                      num_kv_heads=2, block_size=16, dtype=dtype,
                                                      kernels=("tvm.linear",))
            finally:
                if saved_env is None:
                    os.environ.pop(tvm_kernels.BF16_GEMM_ENV)
                else:
                    os.environ[tvm_kernels.BF16_GEMM_ENV] = saved_env
                tvm_kernels._bf16_choice[:] = saved_choice
            assert record["library"] == "cpu.so" and module.LIBRARY is not None, record.get("reason")
            cache[dtype] = module
        return cache[dtype]

    return get


# (rows, K, panels): every register-tile height (1-6) and tails of it, K not a multiple of the k-unroll, N from one
# panel to the ~100 M model's fused gate/up width (at 16 columns a panel: AVX2; AVX-512 panels are 32 wide); at 1-3
# rows (tasks of 4 / 3 / 2 panels) panel counts with and without panels left over (5, 1 and 7, 3)
GEMM_SHAPES = [(1, 576, 60), (1, 37, 5), (2, 37, 1), (2, 576, 7), (3, 576, 3), (4, 1536, 36), (5, 64, 192),
               (6, 575, 2), (7, 33, 1), (13, 576, 60), (64, 1536, 36), (0, 64, 1)]


@pytest.mark.parametrize("rows,k,panels", GEMM_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_op_reference(gemm, rows, k, panels, dtype, bias):
    K = gemm(dtype)
    n = panels * K._NR  # output columns: whole panels of this host's library
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(rows * 7 + k)
    wide = torch.randn(rows, k + 5, generator=g).to(torch_dtype)
    x = wide[:, 2:2 + k]  # rows strided, as a slice of a fused projection is
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch_dtype)
    b = torch.randn(n, generator=g).to(torch_dtype) if bias else None
    ctx = RefContext(positions=torch.arange(rows))
    ref = OPS["linear"].reference(ctx, *(t.double() for t in (x, w, *((b,) if bias else ()))))
    packed = K.pack_weight(w)
    assert isinstance(packed, K.PackedWeight) and packed.shape == w.shape and packed.nbytes == w.numel() * w.element_size()
    out = K.linear(x, packed, b)
    assert out.dtype == torch_dtype and out.shape == (rows, n)
    tol = 1e-5 if dtype == "float32" else 2e-2  # fp32: sums of up to 1,536 products in fp32
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if dtype == "bfloat16":  # as close as torch's own bf16 GEMM (fp32 accumulation, one rounding)
        torch.testing.assert_close(out, OPS["linear"].reference(ctx, x, w, *((b,) if bias else ())),
                                   rtol=2e-2, atol=2e-2)


def test_linear_of_a_3d_x_and_of_a_column_strided_x(gemm):
    """x of any rank (rows flattened), x with a column stride (copied once), x of the wrong width (an error)."""
    K = gemm("float32")
    w = torch.randn(32, 24)
    packed = K.pack_weight(w)
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(K.linear(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)
    xt = torch.randn(24, 5).T  # column stride 5
    torch.testing.assert_close(K.linear(xt, packed), xt @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="24"):
        K.linear(torch.randn(2, 23), packed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weight_gives_back_its_rows(gemm, dtype):
    """unpack() is the stored weight bit for bit; rows(ids) / embedding() are F.embedding of it (a tied table)."""
    K = gemm(dtype)
    w = torch.randn(3 * K._NR, 40).to(getattr(torch, dtype))  # three panels
    packed = K.pack_weight(w)
    assert torch.equal(packed.unpack(), w)
    ids = torch.tensor([0, 3 * K._NR - 1, K._NR, K._NR - 1, 31, 8, 8], dtype=torch.int32)
    assert torch.equal(packed.rows(ids), torch.nn.functional.embedding(ids, w))
    assert torch.equal(K.embedding(ids, packed), torch.nn.functional.embedding(ids, w))
    assert torch.equal(K.embedding(ids, w), torch.nn.functional.embedding(ids, w))  # a plain table: F.embedding


def test_logits_matches_op_reference(gemm):
    K = gemm("float32")
    g = torch.Generator().manual_seed(3)
    x, table = torch.randn(9, 64, generator=g), torch.randn(4096, 64, generator=g)
    indices = torch.tensor([0, 4, 8], dtype=torch.int32)
    out = K.logits(x, K.pack_weight(table), indices)
    ref = OPS["logits"].reference(RefContext(positions=torch.arange(3)), x[indices.long()], table)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-5)


def test_pack_weights_holds_each_weight_once(gemm):
    """model.py's K.pack_weights(weights, PACKED_WEIGHTS): in place; a tensor stored under two names packed once;
    one that another name reads unpacked, or that the kernel does not take, left as stored; a packed original is
    freed once the dict lets go of it."""
    import gc
    import weakref

    K = gemm("float32")
    tied, own, shared, odd = torch.randn(64, 16), torch.randn(32, 16), torch.randn(16, 16), torch.randn(40, 16)
    weights = {"embed": tied, "lm_head": tied, "wq": own, "a": shared, "b": shared, "odd": odd, "norm": torch.ones(16)}
    alive = {name: weakref.ref(t) for name, t in (("tied", tied), ("own", own), ("shared", shared))}
    K.pack_weights(weights, {"embed", "lm_head", "wq", "a", "odd"})
    assert isinstance(weights["embed"], K.PackedWeight) and weights["lm_head"] is weights["embed"]
    assert isinstance(weights["wq"], K.PackedWeight) and torch.equal(weights["wq"].unpack(), own)
    assert weights["a"] is shared and weights["b"] is shared  # "b" is not packed-only: both keep the tensor
    assert weights["odd"] is odd and weights["norm"].dtype == torch.float32  # 40 rows are not whole panels
    del tied, own, shared
    gc.collect()
    assert alive["tied"]() is None and alive["own"]() is None and alive["shared"]() is not None


def test_gemms_the_library_does_not_cover_run_the_torch_kernel(gemm, monkeypatch):
    """N not a whole number of panels, another dtype, a weight that needs grad: not packed, so kernels/cpu.py's
    linear; and a weight passed unpacked runs torch's too."""
    K = gemm("float32")
    calls = []
    real = K._ref.linear
    monkeypatch.setattr(K._ref, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 64)
    weights = (torch.randn(40, 64), torch.randn(32, 64, dtype=torch.float64), torch.randn(32, 64, requires_grad=True),
               torch.randn(32, 64))
    for w in weights[:3]:
        assert K.pack_weight(w) is w
    for w in weights:
        xw = x.to(w.dtype)
        torch.testing.assert_close(K.linear(xw, K.pack_weight(w) if w is not weights[3] else w), xw @ w.T)
    assert calls == [1, 1, 1, 1]


def test_bf16_gemm_backend_follows_the_cpu_flags(monkeypatch, caplog):
    """Native bf16 (avx512_bf16 or amx_bf16) -> oneDNN's GEMMs over prepacked weights (F.linear over stored ones
    where torch lacks the prepacked ops), else the TVM kernel; the env var overrides; the process's decision is made
    from /proc/cpuinfo once and logged in one line; a bad value is an error, and so is a forced oneDNN where this
    torch/CPU has no oneDNN bf16 matmul."""
    native = "onednn" if tvm_kernels.onednn_bf16_available() else "torch"
    monkeypatch.delenv(tvm_kernels.BF16_GEMM_ENV, raising=False)
    assert tvm_kernels.bf16_gemm_backend(frozenset({"avx2", "fma", "f16c"})) == "tvm"
    assert tvm_kernels.bf16_gemm_backend(frozenset({"avx512f", "avx512_bf16"})) == native
    assert tvm_kernels.bf16_gemm_backend(frozenset({"amx_bf16", "amx_tile"})) == native
    monkeypatch.setattr(tvm_kernels, "onednn_bf16_available", lambda: False)
    assert tvm_kernels.bf16_gemm_backend(frozenset({"avx512f", "avx512_bf16"})) == "torch"
    monkeypatch.setenv(tvm_kernels.BF16_GEMM_ENV, "onednn")
    with pytest.raises(ValueError, match="no oneDNN bf16 matmul"):
        tvm_kernels.bf16_gemm_backend(frozenset({"avx512_bf16"}))
    monkeypatch.setattr(tvm_kernels, "onednn_bf16_available", lambda: True)
    assert tvm_kernels.bf16_gemm_backend(frozenset({"avx2"})) == "onednn"
    monkeypatch.setenv(tvm_kernels.BF16_GEMM_ENV, "tvm")
    assert tvm_kernels.bf16_gemm_backend(frozenset({"amx_bf16"})) == "tvm"
    monkeypatch.setenv(tvm_kernels.BF16_GEMM_ENV, "torch")
    assert tvm_kernels.bf16_gemm_backend(frozenset({"amx_bf16"})) == "torch"
    monkeypatch.setenv(tvm_kernels.BF16_GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="KILN_CPU_BF16_GEMM='mkl'"):
        tvm_kernels.bf16_gemm_backend(frozenset())
    monkeypatch.delenv(tvm_kernels.BF16_GEMM_ENV)
    monkeypatch.setattr(tvm_kernels, "_bf16_choice", [])
    monkeypatch.setattr(tvm_kernels, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    with caplog.at_level(logging.INFO, logger="kiln.runtime.tvm_kernels"):
        assert tvm_kernels.bf16_gemm_backend() == "onednn" and tvm_kernels.bf16_gemm_backend() == "onednn"
    lines = [r.getMessage() for r in caplog.records if "bf16 GEMMs" in r.getMessage()]
    assert lines == ["kiln: bf16 GEMMs on oneDNN (native bf16, weights prepacked in its blocked layout) "
                     "(this CPU has avx512_bf16)"]


@pytest.mark.skipif(not tvm_kernels.onednn_bf16_available(),
                    reason="hardware: this CPU (or torch build) has no oneDNN bf16 matmul (avx512_bf16 / amx_bf16); "
                           "the choice itself is tested by test_bf16_gemm_backend_follows_the_cpu_flags")
def test_bf16_library_prepacks_weights_for_onednn(tmp_path, monkeypatch):
    """A bf16 library whose choice is onednn holds each packed weight once, in oneDNN's blocked layout, and its
    GEMMs give F.linear's result over the weight as stored, bit for bit: rows 1 to 200, a strided x, a 3-d x,
    a bias, no rows; a tied table serves embedding lookups and the LM head; the row kernels still run on TVM."""
    monkeypatch.setattr(tvm_kernels, "_bf16_choice", ["onednn"])
    K, record = build_kernel_package(tmp_path, head_dim=64, num_heads=8, num_kv_heads=2, block_size=16,
                                     dtype="bfloat16", kernels=("tvm.linear", "tvm.rms_norm"))
    assert record["library"] == "cpu.so" and K._GEMMS == "onednn" and K._RMS_NORM is not None
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(200, 96, generator=g) / 10).bfloat16()  # 200 columns: no panel multiple needed
    b = torch.randn(200, generator=g).bfloat16()
    weights = {"wq": w, "alias": w, "other": torch.randn(8, 96).bfloat16()}
    K.pack_weights(weights, {"wq", "alias"})
    packed = weights["wq"]
    assert isinstance(packed, K.PackedWeight) and weights["alias"] is packed and packed.panels.is_mkldnn
    assert packed.shape == w.shape and packed.nbytes == w.numel() * 2 and weights["other"].dtype == torch.bfloat16
    for rows in (1, 2, 7, 64, 200):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        assert torch.equal(K.linear(x, packed), torch.nn.functional.linear(x, w))
        assert torch.equal(K.linear(x, packed, b), torch.nn.functional.linear(x, w, b))
    wide = torch.randn(5, 100, generator=g).bfloat16()
    assert torch.equal(K.linear(wide[:, 2:98], packed), torch.nn.functional.linear(wide[:, 2:98], w))
    x3 = torch.randn(2, 3, 96, generator=g).bfloat16()
    assert torch.equal(K.linear(x3, packed), torch.nn.functional.linear(x3, w))
    assert K.linear(torch.zeros(0, 96).bfloat16(), packed).shape == (0, 200)
    ids = torch.tensor([0, 199, 5, 5])
    assert torch.equal(K.embedding(ids, packed), w[ids])
    x = torch.randn(4, 96, generator=g).bfloat16()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    logits = K.logits(x, packed, idx)
    assert logits.dtype == torch.float32 and torch.equal(logits, torch.nn.functional.linear(x[[3, 1]], w).float())
    with pytest.raises(ValueError, match="x has 95 features"):
        K.linear(torch.randn(2, 95).bfloat16(), packed)


def test_bf16_library_leaves_gemms_to_torch_on_native_bf16(tmp_path, monkeypatch):
    """A bf16 library on a host whose choice is torch (native bf16, no prepacked oneDNN ops in this torch) packs
    nothing: weights stay as stored, GEMMs run kernels/cpu.py's linear; the row and attention kernels still run
    on TVM."""
    monkeypatch.setattr(tvm_kernels, "_bf16_choice", ["torch"])
    K, record = build_kernel_package(tmp_path, head_dim=64, num_heads=8, num_kv_heads=2, block_size=16,
                                     dtype="bfloat16", kernels=("tvm.linear", "tvm.rms_norm"))
    assert record["library"] == "cpu.so" and K.LIBRARY is not None
    w = torch.randn(32, 64).bfloat16()
    assert K.pack_weight(w) is w
    weights = {"wq": w}
    K.pack_weights(weights, {"wq"})
    assert weights["wq"] is w
    calls = []
    real = K._ref.linear
    monkeypatch.setattr(K._ref, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(K.linear(x, w), torch.nn.functional.linear(x, w))
    assert calls == [1] and K._RMS_NORM is not None
