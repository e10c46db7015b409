"""Shared by fuse_qkv and fuse_gate_up: the guards, patterns and replacements that merge sibling linears into
one (fuse_expert_gate_up reuses the param guard, `concatenable`).

Sibling linears read the same input; each weight (and bias, if any) is a `param`. The merged linear reads a
new param whose `source` is the siblings' sources in role order, concatenated along dim 0, so the weight
converter builds the fused tensor from the checkpoint exactly as the separate ones were built; each old
linear's value becomes a `slice` of the merged output.

Quantized siblings (after quantize_weights) merge where concatenating their quantized tensors is exact —
every output row keeps the values and scale it had:
* fp8 (weight-only `dequant_fp8`, or w8a8 `linear_fp8`): the e4m3 weights concatenate along N; per-channel
  scales concatenate; per-tensor scales become one per output row (each part's scale repeated over its
  rows, so the merged op is per-channel); 128x128 block scales concatenate along N when every part's N is a
  multiple of the block (else a block would straddle two projections, and they stay separate).
* fp8 with static activation scales (`linear_fp8` act=static, compressed-tensors `input_scale`): q, k and v
  (gate and up) read the same x, so the merged GEMM quantizes x once, with one scale: the largest of the
  parts' scales (vLLM does the same). llm-compressor calibrates each projection's scale from that same x, so
  they are normally equal and the merge is exact; where they differ, a part with a smaller scale sees x
  rounded on a coarser grid (and no clipping it would not also have) — bounded in tests/quant.
* int4 AWQ (`dequant_int4`, format awq): qweight [K, N/8], qzeros [K/g, N/8] and scales [K/g, N] pack
  output columns along dim 1, in whole int32 words (N is a multiple of 8), so they concatenate along dim 1.
* int4 GPTQ is left unmerged: its g_idx [K] is one per projection, and act-order checkpoints may order q,
  k and v (or gate and up) differently; whether they agree is known only from the checkpoint's tensors,
  after the passes ran.
The merged params' `quant` attrs carry `parts` ((original param, rows), ...): the weight converter
(codegen/quant_weights.py) builds each part as it would have unmerged (loaded, or quantized at compile time
with the part's own scale) and concatenates them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kiln.compiler import Attrs, ParamSpec
from kiln.compiler.rewrite import Builder, Match, P, Pat, V


def fusible_linears(m: Match, roles: Sequence[str], bias: bool) -> bool:
    """Guard: distinct linears over plain, same-dtype, unquantized, unsharded params of one block."""
    if len({m[r] for r in roles}) != len(roles):
        return False
    groups = [[m.param(f"w{r}") for r in roles]] + ([[m.param(f"b{r}") for r in roles]] if bias else [])
    return all(concatenable(specs) for specs in groups)


def concatenable(specs: Sequence[ParamSpec]) -> bool:
    """Same dtype and block, unquantized, unsharded, equal trailing dims, all from the checkpoint or none."""
    first = specs[0]
    for s in specs:
        if s.dtype != first.dtype or s.block != first.block or s.quant is not None or s.sharding is not None:
            return False  # quantized/sharded weights carry per-tensor state a plain concat would break
        if len(s.source) > 1 and s.concat_dim != 0:
            return False
        if s.shape[1:] != first.shape[1:]:
            return False
    return len({bool(s.source) for s in specs}) == 1  # all from the checkpoint, or all generated


def concat_params(specs: Sequence[ParamSpec], local_name: str) -> ParamSpec:
    """The ParamSpec of `specs` concatenated along dim 0, named `{block}.{local_name}`."""
    first = specs[0]
    name = f"{first.block}.{local_name}" if first.block else local_name
    rows = sum(s.shape[0] for s in specs)
    return dataclasses.replace(first, name=name, shape=(rows, *first.shape[1:]),
                               source=tuple(src for s in specs for src in s.source), concat_dim=0)


def fuse_linears(m: Match, b: Builder, roles: Sequence[str], bias: bool, fused: str) -> dict[str, str]:
    """linear(x, w_r[, b_r]) for each role r -> y = linear(x, w_fused[, b_fused]); r -> slice(y, ...).

    `fused` names the merged value and params: w{fused} / b{fused} (e.g. "qkv" -> decoder.wqkv)."""
    weights = [m.param(f"w{r}") for r in roles]
    inputs = [m["x"], b.add_param(concat_params(weights, f"w{fused}"), after=weights[0].name)]
    inputs += _merged_bias(m, b, roles, bias, fused)
    y = b.add("linear", inputs, hint=fused)
    return _slices(m, b, roles, y, [w.shape[0] for w in weights])


def _merged_bias(m: Match, b: Builder, roles: Sequence[str], bias: bool, fused: str) -> list[str]:
    if not bias:
        return []
    biases = [m.param(f"b{r}") for r in roles]
    return [b.add_param(concat_params(biases, f"b{fused}"), after=biases[0].name)]


def _slices(m: Match, b: Builder, roles: Sequence[str], y: str, rows: Sequence[int]) -> dict[str, str]:
    out: dict[str, str] = {}
    start = 0
    for r, n in zip(roles, rows, strict=True):
        out[r] = b.add("slice", (y,), hint=m[r], start=start, stop=start + n)
        start += n
    return out


# ---------------------------------------------------------------- quantized siblings

# The op a quantized projection reads its weight through -> its param inputs, in order. `linear_fp8` is the
# w8a8 form (act=dynamic), which quantize_weights emits directly: its params are the GEMM's inputs 1 and 2;
# "linear_fp8_static" is the same op with act=static, whose input 3 is the activation's scale.
QUANT_WEIGHT_OPS = {"dequant_fp8": 2, "dequant_int4": 3, "linear_fp8": 2, "linear_fp8_static": 3}
_GEMM_OPS = {"linear_fp8": "linear_fp8", "linear_fp8_static": "linear_fp8"}  # keys of QUANT_WEIGHT_OPS that are GEMMs


def quantized_projection(op: str, role: str, bias: bool, through: Sequence[str] = ()) -> Pat:
    """The pattern of role r's projection of x whose weight is quantized: linear(x, dequant(p...)[, b]), or
    for op "linear_fp8" linear_fp8(x, w, s[, b]). Binds r (the projection), dq{r} (its dequant or itself),
    {r}_p0, {r}_p1, ... (the quantized params) and b{r}."""
    params = [P("param", name=f"{role}_p{i}") for i in range(QUANT_WEIGHT_OPS[op])]
    tail = (P("param", name=f"b{role}"),) if bias else ()
    if op in _GEMM_OPS:
        return P(_GEMM_OPS[op], V("x"), *params, *tail, name=role, through=through)
    return P("linear", V("x"), P(op, *params, name=f"dq{role}"), *tail, name=role, through=through)


def _quant_node(m: Match, op: str, role: str):
    return m.node(role if op in _GEMM_OPS else f"dq{role}")


def fusible_quantized(m: Match, op: str, roles: Sequence[str], bias: bool) -> bool:
    """Guard: distinct projections, one quantization (same op attributes, same K, unsharded params of one
    block, each from one checkpoint weight), and an exact concatenation (see the module docstring)."""
    if len({m[r] for r in roles}) != len(roles):
        return False
    attrs = {_strip(_quant_node(m, op, r).attrs) for r in roles}
    if len(attrs) != 1:
        return False
    a = dict(attrs.pop())
    if op == "dequant_int4" and a.get("format") != "awq":
        return False
    if op in _GEMM_OPS and (op == "linear_fp8_static") != (a.get("act") == "static_per_tensor"):
        return False  # a static linear_fp8's input 3 is its activation scale, not a bias
    for i in range(QUANT_WEIGHT_OPS[op]):
        specs = [m.param(f"{r}_p{i}") for r in roles]
        if any(s.quant is None or s.sharding is not None or s.quant.get("parts") for s in specs):
            return False
        if len({(s.block, s.dtype, s.quant["weight_shape"][1], len(s.source)) for s in specs}) != 1:
            return False
    rows = [m.param(f"{r}_p0").quant["weight_shape"][0] for r in roles]
    if a.get("granularity") == "block" and any(n % a["block"] for n in rows):
        return False
    return not bias or concatenable([m.param(f"b{r}") for r in roles])


def _strip(attrs: Attrs) -> Attrs:
    return Attrs({k: v for k, v in attrs.items() if k != "kernel"})


def _merged_quant_param(specs: Sequence[ParamSpec], fused_of: str, parts: tuple) -> ParamSpec:
    """The concatenation of one quantized tensor of every part (e.g. the wq, wk, wv fp8 weights)."""
    first, q = specs[0], specs[0].quant
    n = sum(rows for _, rows in parts)
    role, k = q["role"], q["weight_shape"][1]
    suffix = first.name[len(q["of"]):]  # "decoder.wq_fp8" -> "_fp8"
    if role == "input_scale":  # one activation x feeds every part: one scale, the parts' max (see fuse_*)
        dim, shape = 0, (1,)
    elif q["scheme"] == "fp8":
        dim = 0
        shape = (n, k) if role == "weight" else (n,) if q["granularity"] in ("tensor", "channel") else (
            sum(s.shape[0] for s in specs), first.shape[1])
    else:  # awq: output columns along dim 1 (qweight in int32 words of 8)
        dim = 1
        shape = (first.shape[0], sum(s.shape[1] for s in specs))
    quant = Attrs({**q, "of": fused_of, "weight_shape": (n, k), "parts": parts})
    return dataclasses.replace(first, name=f"{fused_of}{suffix}", shape=shape, concat_dim=dim, quant=quant,
                               source=tuple(src for s in specs for src in s.source))


def fuse_quantized_linears(m: Match, b: Builder, op: str, roles: Sequence[str], bias: bool,
                           fused: str) -> dict[str, str]:
    """The quantized projections of `roles` -> one over merged quantized params `{block}.w{fused}_*`, read
    through one dequant (or one linear_fp8) with the siblings' attributes — per-tensor fp8 scales become
    per-channel — and sliced back per role."""
    weights = [m.param(f"{r}_p0") for r in roles]
    block = weights[0].block
    fused_of = f"{block}.w{fused}" if block else f"w{fused}"
    parts = tuple((w.quant["of"], w.quant["weight_shape"][0]) for w in weights)
    params = []
    for i in range(QUANT_WEIGHT_OPS[op]):
        specs = [m.param(f"{r}_p{i}") for r in roles]
        params.append(b.add_param(_merged_quant_param(specs, fused_of, parts), after=specs[0].name))
    attrs = dict(_strip(_quant_node(m, op, roles[0]).attrs))
    if attrs.get("granularity") == "tensor":
        attrs["granularity"] = "channel"
    tail = _merged_bias(m, b, roles, bias, fused)
    if op in _GEMM_OPS:
        y = b.add(_GEMM_OPS[op], (m["x"], *params, *tail), hint=fused, **attrs)
    else:
        dq = b.add(op, params, hint=f"w{fused}_dq", **attrs)
        y = b.add("linear", (m["x"], dq, *tail), hint=fused)
    return _slices(m, b, roles, y, [n for _, n in parts])
