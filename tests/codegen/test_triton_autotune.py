"""Autotuning of the decode-critical Triton kernels (paged decode attention, MLA decode, the weight-only
quantized GEMM), under the interpreter.

Every candidate config of each kernel is run once, forced through the launcher's `config=`, at a tiny shape
against the torch references (the CPU library for attention, the op table for the quantized GEMM), with
contexts long enough to take several split-KV partitions (the smallest partition valid for the config) and
with the config's own partition; the GEMM as a GEMV (one row) and with tensor-core dots (5 rows), int4 with a
bias and split-K, and act-order GPTQ. Then the tuner itself: one config under the interpreter, the fastest of
the timed configs chosen once per key (a fake `do_bench` runs each candidate for real on the synthetic
context and returns a made-up time), keys that ignore sequence lengths, and no tuning inside a capture.
Tolerances as in test_triton_kernels.py / test_triton_moe_mla.py / test_triton_quant_gemm.py.
"""
from __future__ import annotations

import os
import pathlib
import tempfile

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import mla_inputs, render_kernels  # noqa: E402
from kiln.compiler.ops import OPS, RefContext  # noqa: E402
from test_triton_kernels import _batch  # noqa: E402

# rendered at collection: the candidate lists parametrize the tests below
_K = render_kernels(pathlib.Path(tempfile.mkdtemp(prefix="kiln_autotune_")))
DECODE_ALL = [_K._decode_default()] + _K.DECODE_CONFIGS
MLA_ALL = [_K._mla_default()] + _K.MLA_CONFIGS
WQ_ALL = [_K._wq_default()] + _K.WQ_CONFIGS


@pytest.fixture
def K():
    return _K


@pytest.fixture(autouse=True)
def fresh_cache(K):
    K._TUNED.clear()
    yield
    K._TUNED.clear()


def _ids(configs):
    return [",".join(f"{k}={v}" for k, v in c.items() if k != "num_stages") for c in configs]


# ---------------------------------------------------------------- the config lists


def test_config_lists_are_well_formed(K):
    assert not K.AUTOTUNE, "under the interpreter only the rendered defaults may run"
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
    for configs in (DECODE_ALL, MLA_ALL, WQ_ALL):
        assert 2 <= len(configs) <= 8, "each tuned kernel times at most 8 configs per key (warm-up time)"
        assert len({tuple(sorted(c.items())) for c in configs}) == len(configs), "duplicate configs"
    for c in DECODE_ALL + MLA_ALL:
        assert pow2(c["block_n"]) and c["block_n"] >= 16 and c["partition"] % c["block_n"] == 0, c
    for c in MLA_ALL:
        assert pow2(c["block_h"]) and c["block_h"] >= 16 and pow2(c["v_split"]), c
    for c in WQ_ALL:
        assert pow2(c["block_n"]) and c["block_n"] >= 16 and pow2(c["block_k"]) and c["block_k"] >= 16, c
        assert c["split_target"] >= 1
        assert c["block_n"] * c["block_k"] <= 64 * 32 * c["num_warps"], f"GEMV accumulator > 64 regs/thread: {c}"


# ---------------------------------------------------------------- paged decode attention, every config


def _decode_check(K, seqs, cfg, *, heads=8, kv_heads=2, head_dim=16, block_size=4, partition=None):
    R = K._ref
    g = torch.Generator().manual_seed(sum(c for c, _ in seqs) + heads)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    batch = _batch(seqs, block_size, num_blocks, g)
    T = batch.num_tokens
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g)
    q, k, v = (torch.randn(T, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    scale = head_dim ** -0.5
    kv_ref = kv.clone()
    ref = R.paged_attention(q, k, v, kv_ref, batch, scale=scale)
    out = K.paged_attention(q, k, v, kv, batch, scale, partition_size=partition, config=cfg)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cfg", DECODE_ALL, ids=_ids(DECODE_ALL))
def test_decode_every_config_matches_cpu(K, cfg):
    # the smallest partition the config allows: contexts of 70 / 37 / 7 tokens take several partitions + merge
    _decode_check(K, [(69, 1), (36, 1), (6, 1)], cfg, partition=cfg["block_n"])
    _decode_check(K, [(40, 1), (2, 1)], cfg)  # the config's own partition: one, no merge


# ---------------------------------------------------------------- MLA decode, every config


def _mla_check(K, seqs, cfg, *, heads, partition=None, lora=64, rope_dim=8, dn=8, dv=8, block_size=4,
               dtype=torch.float32):
    R = K._ref
    g = torch.Generator().manual_seed(sum(c for c, _ in seqs) + heads)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    batch = _batch(seqs, block_size, num_blocks, g)
    T = batch.num_tokens
    kv = torch.randn(num_blocks, block_size, lora + rope_dim, generator=g).to(dtype)
    q_nope, q_pe, c_kv, k_pe, w_kv_b = mla_inputs(T, heads, lora, rope_dim, dn, dv, dtype, g)
    scale = (dn + rope_dim) ** -0.5
    kv_ref = kv.clone().float()
    ref = R.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(), kv_ref, batch,
                          scale=scale, absorb="decode")
    out = K.mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b, kv, batch, scale, "decode", partition_size=partition,
                          config=cfg)
    assert out.shape == (T, heads * dv) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("cfg", MLA_ALL, ids=_ids(MLA_ALL))
def test_mla_every_config_matches_cpu(K, cfg):
    # 20 heads: one or two head blocks; latent width 64: V splits of up to 4 x 16 columns
    _mla_check(K, [(36, 1), (64, 1), (0, 1)], cfg, heads=20, partition=cfg["block_n"])
    _mla_check(K, [(40, 1), (2, 1)], cfg, heads=20)


def test_mla_v_split_bf16_and_mixed_batch(K):
    """The V-split path in bf16, next to a prefill (which runs torch)."""
    cfg = dict(block_h=16, block_n=16, v_split=4, partition=16, num_warps=4, num_stages=2)
    _mla_check(K, [(20, 1), (5, 1), (13, 9)], cfg, heads=4, dtype=torch.bfloat16)


# ---------------------------------------------------------------- weight-only quantized GEMM, every config


def _words(g, *shape):
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def _reference(op, x, *ins, **attrs):
    return OPS[op].reference(RefContext(positions=torch.zeros(0, dtype=torch.int64)), x, *ins, **attrs)


@pytest.mark.parametrize("cfg", WQ_ALL, ids=_ids(WQ_ALL))
def test_wq_gemm_every_config_matches_reference(K, cfg):
    n, k, group = 80, 256, 128  # N not a multiple of any column tile; two groups
    g = torch.Generator().manual_seed(cfg["block_n"] + cfg["block_k"])
    qweight, qzeros = _words(g, k, n // 8), _words(g, k // group, n // 8)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(torch.float16)
    bias = torch.randn(n, generator=g)
    for m, split in ((1, None), (5, 3)):  # GEMV with the config's own split; dots with forced split-K
        x = torch.randn(m, k, generator=g)
        out = K.wq_gemm(x, qweight, qzeros, scales, None, bias, format="awq", group=group, split_k=split,
                        config=cfg)
        ref = _reference("linear_w4a16", x, qweight, qzeros, scales, bias, format="awq", group=group, zero_offset=0)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # act-order GPTQ: per-row groups
    gq, gz = _words(g, k // 8, n), _words(g, k // group, n // 8)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)].to(torch.int32)
    x = torch.randn(1, k, generator=g)
    out = K.wq_gemm(x, gq, gz, scales, g_idx, None, format="gptq", group=group, zero_offset=1, config=cfg)
    ref = _reference("linear_w4a16", x, gq, gz, scales, g_idx, format="gptq", group=group, zero_offset=1)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the tuner


@pytest.fixture
def fake_timing(K, monkeypatch):
    """Autotuning on, do_bench replaced: each candidate really runs once (on the synthetic context) and is
    'timed' by `times[i]` of its position in the list; returns the list of configs it was asked to time."""
    timed = []
    state = {"times": None}

    def do_bench(fn, warmup, rep):
        fn()
        timed.append(None)
        return state["times"][(len(timed) - 1) % len(state["times"])]

    monkeypatch.setattr(K, "AUTOTUNE", True)
    monkeypatch.setattr(K.triton.testing, "do_bench", do_bench)
    return timed, state


def test_tuner_picks_fastest_once_per_bucket_whatever_the_context(K, fake_timing):
    timed, state = fake_timing
    n = 1 + len(K.DECODE_CONFIGS)
    state["times"] = [5.0] * n
    state["times"][3] = 1.0  # DECODE_CONFIGS[2]
    _decode_check(K, [(30, 1), (9, 1), (2, 1)], None)
    assert len(timed) == n
    (key, chosen), = K.tuned_configs().items()
    assert key.startswith("decode 4 8 2 16 float32 4 ") and chosen == K.DECODE_CONFIGS[2]
    # other lengths, 3 rows again (same power-of-two bucket), the same block-table width: no new timing, and
    # the chosen config's output still matches
    _decode_check(K, [(29, 1), (1, 1), (17, 1)], None)
    assert len(timed) == n and len(K.tuned_configs()) == 1
    _decode_check(K, [(29, 1), (1, 1), (17, 1), (3, 1), (8, 1)], None)  # 5 rows: a new bucket
    assert len(timed) == 2 * n and len(K.tuned_configs()) == 2


def test_tuner_skips_failing_configs_and_tunes_mla_and_wq(K, fake_timing, monkeypatch):
    timed, state = fake_timing
    state["times"] = [float("inf"), 2.0, 1.5] + [3.0] * 8  # the default "fails": inf
    _mla_check(K, [(30, 1), (9, 1)], None, heads=20)
    chosen = K.tuned_configs()
    assert list(chosen.values()) == [K.MLA_CONFIGS[1]]
    assert list(chosen)[0].startswith("mla_decode 2 20 64 8 float32 4 ")
    K._TUNED.clear()
    timed.clear()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=g)
    qweight, qzeros = _words(g, 128, 4), _words(g, 1, 4)
    scales = (torch.rand(1, 32, generator=g) * 0.02).to(torch.float16)
    out = K.wq_gemm(x, qweight, qzeros, scales, None, None, format="awq", group=128)
    ref = _reference("linear_w4a16", x, qweight, qzeros, scales, format="awq", group=128, zero_offset=0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert len(timed) == 1 + len(K.WQ_CONFIGS)
    assert K.tuned_configs() == {"wq_gemm 4 32 128 awq 128 False False float32": K.WQ_CONFIGS[1]}


def test_tuner_off_and_inside_capture_use_the_default(K, fake_timing, monkeypatch):
    timed, state = fake_timing
    state["times"] = [9.0, 1.0]
    configs = [{"a": 0}, {"a": 1}]
    monkeypatch.setattr(K.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(K.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert K._pick("k", (1,), configs, lambda: lambda cfg: None) == configs[0] and not timed and not K._TUNED
    monkeypatch.setattr(K.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(K.torch.cuda, "empty_cache", lambda: None)
    assert K._pick("k", (1,), configs, lambda: lambda cfg: None) == configs[1] and len(timed) == 2
    assert K._pick("k", (1,), configs, lambda: lambda cfg: None) == configs[1] and len(timed) == 2  # cached
    monkeypatch.setattr(K, "AUTOTUNE", False)
    _decode_check(K, [(5, 1)], None)  # KILN_AUTOTUNE=0: the default, nothing timed
    assert len(timed) == 2 and "decode" not in " ".join(K.tuned_configs())
