"""Quantization numerics shared by the op references, the weight converter and calibration.

Conventions (those of the checkpoints kiln loads):

* FP8 is float8 e4m3fn (max 448). A weight is `w ≈ w_q.float() * scale` with `scale` per tensor ([1]),
  per output channel ([N]) or per 128×128 block ([ceil(N/B), ceil(K/B)], DeepSeek's `weight_scale_inv`,
  which despite its name multiplies). Scales are absmax / 448, so the largest magnitude maps to 448.
* MXFP4 (OCP microscaling, OpenAI's gpt-oss experts): blocks of 32 e2m1 values (two a byte, the low nibble
  first) sharing one e8m0 scale 2^(s - 127); a [..., out, in] weight is stored as `_blocks` uint8
  [..., out, in/32, 16] and `_scales` uint8 [..., out, in/32] (transformers' integrations/mxfp4.py).
* INT4 weight-only keeps the layouts AutoAWQ (GEMM) and AutoGPTQ/GPTQModel publish; `dequant_awq` and
  `dequant_gptq` give the [N, K] float weight (out_features × in_features, as nn.Linear stores it).

The artifact's kernels carry their own copy of these formulas (an artifact imports only torch); the
kernel tests hold the two equal.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero tensor still gets a finite scale

# AutoAWQ's GEMM packing: nibble i of a packed int32 holds column AWQ_PACK_ORDER[i] of its group of 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_GRANULARITIES = ("tensor", "channel", "block")
INT4_FORMATS = ("awq", "gptq")


def fp8_cast(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to e4m3 (a plain `.to()` turns out-of-range values into NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_to(w: torch.Tensor, block: int) -> torch.Tensor:
    n, k = w.shape
    pn, pk = -n % block, -k % block
    return torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w


def fp8_quantize(w: torch.Tensor, granularity: str = "tensor", block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (e4m3 weight [N, K], f32 scale) with w ≈ dequant(w_q, scale)."""
    assert granularity in FP8_GRANULARITIES, f"unknown fp8 granularity {granularity!r}"
    w = w.float()
    if granularity == "tensor":
        scale = (w.abs().amax() / FP8_MAX).clamp(min=_MIN_SCALE).reshape(1)
        return fp8_cast(w / scale), scale
    if granularity == "channel":
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
        return fp8_cast(w / scale[:, None]), scale
    n, k = w.shape
    padded = _pad_to(w, block)
    bn, bk = padded.shape[0] // block, padded.shape[1] // block
    amax = padded.reshape(bn, block, bk, block).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return fp8_cast(w / expand_block_scale(scale, block, n, k)), scale


def expand_block_scale(scale: torch.Tensor, block: int, n: int, k: int) -> torch.Tensor:
    """[ceil(N/B), ceil(K/B)] block scales -> [N, K], one value per weight element."""
    return scale.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]


def fp8_dequantize(w_q: torch.Tensor, scale: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Exact f32 value of an e4m3 weight [N, K] under a per-tensor [1], per-channel [N] or block scale."""
    w = w_q.float()
    n, k = w.shape
    if scale.dim() == 2:
        assert block > 0, "block scales need the block size"
        return w * expand_block_scale(scale.float(), block, n, k)
    if scale.numel() == 1:
        return w * scale.float().reshape(())
    return w * scale.float()[:, None]


def fp8_quantize_per_token(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: [T, K] -> (e4m3 [T, K], f32 scale [T, 1]); with `group` > 0 one
    scale per token per `group` columns ([T, ceil(K/group)], DeepSeek's 1×128 activation tiles)."""
    xf = x.float()
    if group <= 0:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
        return fp8_cast(xf / scale), scale
    k = xf.shape[-1]
    padded = torch.nn.functional.pad(xf, (0, -k % group))
    tiles = padded.reshape(*xf.shape[:-1], -1, group)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return fp8_cast(xf / scale.repeat_interleave(group, dim=-1)[..., :k]), scale


def fp8_scaled_matmul(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: int = 0) -> torch.Tensor:
    """What `torch._scaled_mm` computes for fp8 activations quantized per token (per token and 128-column
    tile for block-scaled weights) times an fp8 weight: products of e4m3 values accumulated in fp32, then
    scaled. Returns f32 [T, N]."""
    n, k = w_q.shape
    if w_scale.dim() == 2:  # block: sum over K tiles of (x_tile @ w_tile.T) · s_x[t, tile] · s_w[n-block, tile]
        x_q, x_scale = fp8_quantize_per_token(x, group=block)
        out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        sw = w_scale.float().repeat_interleave(block, dim=0)[:n]  # [N, K tiles]
        for t in range(x_scale.shape[-1]):
            cols = slice(t * block, min(k, (t + 1) * block))
            partial = x_q[:, cols].float() @ w_q[:, cols].float().T
            out += partial * x_scale[:, t:t + 1] * sw[None, :, t]
        return out
    x_q, x_scale = fp8_quantize_per_token(x)
    sw = w_scale.float().reshape(1, -1) if w_scale.numel() > 1 else w_scale.float().reshape(1, 1)
    return (x_q.float() @ w_q.float().T) * x_scale * sw


def fp8_static_matmul(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor
                      ) -> torch.Tensor:
    """Static W8A8 (compressed-tensors `input_activations.dynamic = false`): x quantized with the calibrated
    per-tensor scale `x_scale` ([1]; values beyond ±448·x_scale saturate), e4m3 products accumulated in fp32,
    then scaled by x_scale · w_scale (per tensor [1] or per output channel [N]) — what `torch._scaled_mm`
    computes with a scalar scale_a. Returns f32 [T, N]."""
    s = x_scale.float().reshape(())
    x_q = fp8_cast(x.float() / s)
    sw = w_scale.float().reshape(1, -1)
    return (x_q.float() @ w_q.float().T) * s * sw


def fp8_fake_quantize(x: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded through e4m3 with one scale per index of `dim` (the KV cache's per-head scales)."""
    shape = [1] * x.dim()
    shape[dim] = -1
    s = scale.float().reshape(shape)
    return (fp8_cast(x.float() / s).float() * s).to(x.dtype)


# ---------------------------------------------------------------- int4 (AWQ / GPTQ)


def _unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (low nibble first), interleaved along `dim` (size x8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    if dim == 1:
        nib = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C, 8]
        return nib.reshape(packed.shape[0], -1)
    nib = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [R, 8, C]
    return nib.reshape(-1, packed.shape[1])


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM packing [R, C/8] int32 -> [R, C] int values 0..15 in column order."""
    nib = _unpack_int4(packed, dim=1).reshape(packed.shape[0], -1, 8)
    reverse = [AWQ_PACK_ORDER.index(j) for j in range(8)]  # column j sits in nibble reverse[j]
    return nib[:, :, reverse].reshape(packed.shape[0], -1)


def dequant_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] -> f32 weight [N, K].
    w[k, n] = (q[k, n] - z[k // g, n]) · s[k // g, n]."""
    q = awq_unpack(qweight).float()
    z = awq_unpack(qzeros).float().repeat_interleave(group, dim=0)
    s = scales.float().repeat_interleave(group, dim=0)
    return ((q - z) * s).T.contiguous()


def dequant_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 zero_offset: int = 1) -> torch.Tensor:
    """AutoGPTQ/GPTQModel: qweight [K/8, N] (packed along K), qzeros [K/g, N/8] (packed along N), scales
    [K/g, N], g_idx [K] (the group of each input row; act-order permutes it) -> f32 weight [N, K].
    w[k, n] = (q[k, n] - (z[g_idx[k], n] + zero_offset)) · s[g_idx[k], n]; zero_offset is 1 for the
    `gptq` (v1) checkpoint format every AutoGPTQ/GPTQModel release writes, 0 for GPTQModel's `gptq_v2`."""
    q = _unpack_int4(qweight, dim=0).float()
    z = _unpack_int4(qzeros, dim=1).float() + zero_offset
    g = g_idx.long()
    return ((q - z[g]) * scales.float()[g]).T.contiguous()


__all__ = ["AWQ_PACK_ORDER", "FP8_DTYPE", "FP8_GRANULARITIES", "FP8_MAX", "INT4_FORMATS", "awq_unpack",
           "dequant_awq", "dequant_gptq", "expand_block_scale", "fp8_cast", "fp8_dequantize", "fp8_fake_quantize",
           "fp8_quantize", "fp8_quantize_per_token", "fp8_scaled_matmul", "fp8_static_matmul", "mxfp4_dequantize",
           "mxfp4_quantize"]


# ---------------------------------------------------------------- MXFP4

MXFP4_BLOCK = 32
MXFP4_CHUNK_ROWS = 1 << 20  # blocks decoded at a time
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., out, G, 16] uint8 e2m1 pairs and [..., out, G] uint8 e8m0 scales -> bf16 [..., out, G * 32]. Exact:
    every e2m1 value times a power of two is a bf16 (the exponent range is fp32's), so any float dtype after it
    holds the same numbers."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8 and blocks.shape[:-1] == scales.shape, \
        f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype}"
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    rows, width = blocks[..., 0].numel(), blocks.shape[-1]
    flat_blocks, flat_scales = blocks.reshape(rows, width), scales.reshape(rows, 1)
    out = torch.empty(rows, 2 * width, dtype=torch.bfloat16)
    for r in range(0, rows, MXFP4_CHUNK_ROWS):  # bounded temporaries: a gpt-oss-120b layer is 1e9 values
        b, e = flat_blocks[r:r + MXFP4_CHUNK_ROWS], flat_scales[r:r + MXFP4_CHUNK_ROWS].to(torch.int32) - 127
        values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).reshape(len(b), 2 * width)
        out[r:r + MXFP4_CHUNK_ROWS] = torch.ldexp(values, e).to(torch.bfloat16)  # low nibble first
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * width * 2)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [..., out, in] weight (in a multiple of 32) -> (blocks, scales) as `mxfp4_dequantize` reads them:
    each block's scale is the power of two that brings its absmax to at most 6, values rounded to the nearest
    e2m1. For tests and tools (a tiny checkpoint in the gpt-oss layout); kiln serves such weights dequantized."""
    *lead, out, k = w.shape
    assert k % MXFP4_BLOCK == 0, f"MXFP4 needs the last dim a multiple of {MXFP4_BLOCK}, got {tuple(w.shape)}"
    g = w.float().reshape(*lead, out, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_VALUES[:8])
    mag = (g.abs() / torch.exp2(exp))[..., None]
    codes = (mag - lut).abs().argmin(dim=-1) + 8 * (g < 0).long()  # sign bit 8
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp[..., 0] + 127).to(torch.uint8)
