"""Reference quantizers for tests/quant: write checkpoints in the layouts the quantization libraries publish.

Independent of kiln's loaders and unpackers on purpose: the packers below are written from the published
layouts with explicit loops and bit shifts (AutoAWQ `WQLinear_GEMM.from_linear`, AutoGPTQ `QuantLinear.pack`),
so a kiln unpacker that disagrees with the format fails here.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import kiln
from kiln.eval import ArtifactScorer

REPO = Path(__file__).resolve().parents[2]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
E4M3_MAX = 448.0


def recipe_text(ckpt: Path, quantize: str = "", dtype: str = "fp32") -> str:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    q = f"  quantize {{ {quantize} }}\n" if quantize else ""
    return (f"recipe tiny {{\n  model = llama(vocab={cfg['vocab_size']}, hidden={cfg['hidden_size']}, "
            f"layers={cfg['num_hidden_layers']}, heads={cfg['num_attention_heads']}, kv_heads={cfg['num_key_value_heads']}, "
            f"ffn={cfg['intermediate_size']}, rope_theta={cfg['rope_theta']}, norm_eps={cfg['rms_norm_eps']}, "
            f"tie_embeddings=false, max_position={cfg['max_position_embeddings']})\n"
            f"  weights = \"hf:{ckpt}\"\n  target = cpu\n  dtype = {dtype}\n{q}}}\n")


def build(ckpt: Path, out: Path, quantize: str = "", dtype: str = "fp32") -> Path:
    recipe = out.parent / f"{out.name}.dsl"
    recipe.write_text(recipe_text(ckpt, quantize, dtype))
    kiln.compile(recipe, out, progress=False)
    return out


def log_probs(art: Path, tokens: list[int]) -> torch.Tensor:
    return ArtifactScorer(art, len(tokens)).log_probs(tokens)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """Mean over positions of KL(p || q)."""
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def rewrite_checkpoint(src: Path, dst: Path, fn) -> Path:
    """Copies checkpoint `src` to `dst` with its tensors replaced by fn(tensors) -> tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    save_file(fn(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- fp8 (compressed-tensors, DeepSeek block)


def fp8_reference(w: torch.Tensor, granularity: str, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale in the checkpoint's shape): compressed-tensors [1] / [N, 1]; DeepSeek [N/B, K/B]."""
    w = w.float()
    n, k = w.shape
    if granularity == "tensor":
        s = (w.abs().max() / E4M3_MAX).reshape(1)
        return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s
    if granularity == "channel":
        s = w.abs().max(dim=1, keepdim=True).values / E4M3_MAX
        return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s  # [N, 1]
    nb, kb = -(-n // block), -(-k // block)
    s = torch.empty(nb, kb)
    full = torch.empty_like(w)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s[i, j] = tile.abs().max() / E4M3_MAX
            full[i * block:(i + 1) * block, j * block:(j + 1) * block] = s[i, j]
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values around |v| (normal: 2^(e-3)/2; subnormal spacing 2^-9)."""
    a = v.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 4)


# ---------------------------------------------------------------- int4: RTN quantizer and the two packers


def rtn_int4(w: torch.Tensor, group: int, sym: bool = False, g_idx: torch.Tensor | None = None):
    """Round-to-nearest 4-bit with per-group scale and zero over the input dim of w [N, K].
    Returns q [K, N] (0..15), zeros [K/g, N], scales fp16 [K/g, N], g_idx [K]."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    wt = w.T.float()
    groups = k // group
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if sym:
            s = torch.maximum(hi.abs(), lo.abs()) / 7.5
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            s = (hi - lo) / 15
            z = torch.round(-lo / s).to(torch.int64)
        scales[g], zeros[g] = s, z
    scales = scales.to(torch.float16)
    s_rows, z_rows = scales.float()[g_idx], zeros[g_idx]
    q = torch.clamp(torch.round(wt / s_rows) + z_rows, 0, 15).to(torch.int64)
    return q, zeros, scales, g_idx


def int4_dequant_reference(q, zeros, scales, g_idx) -> torch.Tensor:
    """[N, K] float weight of the integer tensors: (q - z) * s, by group of each input row."""
    return ((q - zeros[g_idx]).float() * scales.float()[g_idx]).T.contiguous()


def _to_int32(word: int) -> int:
    return word - (1 << 32) if word >= (1 << 31) else word


def _pack_columns(values: torch.Tensor, order) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C/8]; nibble i of word c holds column c*8 + order[i]."""
    rows, cols = values.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int32)
    v = values.tolist()
    for r in range(rows):
        for c in range(cols // 8):
            word = 0
            for i in range(8):
                word |= (v[r][c * 8 + order[i]] & 0xF) << (4 * i)
            out[r, c] = _to_int32(word)
    return out


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM: [R, C] nibbles -> int32 [R, C/8]; nibble i of word c holds column c*8 + AWQ_ORDER[i]."""
    return _pack_columns(values, AWQ_ORDER)


def pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ qweight: [K, N] nibbles -> int32 [K/8, N]; nibble j of word (r, n) holds row r*8 + j."""
    return _pack_columns(values.T, range(8)).T.contiguous()


def pack_gptq_cols(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ qzeros: [G, N] nibbles -> int32 [G, N/8]; nibble j of word (g, c) holds column c*8 + j."""
    return _pack_columns(values, range(8))


def awq_checkpoint(ckpt: Path, dst: Path) -> Path:
    """A copy of checkpoint `ckpt` at `dst` with every `*_proj.weight` replaced by AutoAWQ GEMM tensors
    (RTN int4, group 128): `.qweight`, `.qzeros`, `.scales`."""
    def pack(tensors):
        out = dict(tensors)
        for name in [n for n in tensors if n.endswith("_proj.weight")]:
            q, z, s, _ = rtn_int4(out.pop(name), 128)
            stem = name[: -len(".weight")]
            out.update({f"{stem}.qweight": pack_awq(q), f"{stem}.qzeros": pack_awq(z), f"{stem}.scales": s})
        return out

    return rewrite_checkpoint(ckpt, dst, pack)


def load_cpu_kernels(tmp: Path):
    from kiln.codegen.render import template_env

    path = tmp / "kernels_cpu.py"
    path.write_text(template_env().get_template("cpu/kernels.py.j2").render(kiln_version="test"))
    spec = importlib.util.spec_from_file_location("kiln_quant_test_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
