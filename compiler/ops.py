"""The op table: every IR op's signature, shape rule, torch reference implementation and cost.

Reference implementations give an op's *meaning* on one dense sequence (no KV cache, no batch): the
interpreter (`kiln.compiler.interpret`) runs them to check passes and kernels. Generated kernels
implement the same meaning over the runtime's paged, batched layout.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from kiln.compiler.ir import DTYPE_BYTES, Attrs, Dim, TensorType, TupleType, ValueType, layer_values


class ShapeError(Exception):
    """An op's inputs or attributes do not fit its shape rule."""


@dataclass(frozen=True, slots=True)
class Cost:
    flops: int
    bytes: int


@dataclass(frozen=True, slots=True)
class RefContext:
    """What reference ops may read besides their inputs: one dense sequence."""

    positions: torch.Tensor  # [T] int64


@dataclass(frozen=True)
class OpDef:
    name: str
    min_inputs: int
    max_inputs: int
    infer: Callable[[list[TensorType], Attrs], ValueType]
    reference: Callable[..., Any] | None = None  # reference(ctx, *inputs, **attrs)
    cost: Callable[[list[TensorType], ValueType, Attrs], Cost] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)  # allowed attributes -> default (REQUIRED = must be given)
    per_tensor: bool = False  # `a, b = op(a, b, ...)` applies the op to each tensor argument separately
    varargs_attr: str | None = None  # positional constants collect into this attribute: view(x, 4, 16)
    doc: str = ""


REQUIRED = object()
OPS: dict[str, OpDef] = {}


def register_op(op: OpDef) -> OpDef:
    assert op.name not in OPS, f"op {op.name!r} registered twice"
    OPS[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    return OPS[name]


# ---------------------------------------------------------------- shape helpers


def _same(a: Dim, b: Dim) -> bool:
    return a == b


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ShapeError(msg)


def _nbytes(t: ValueType, symbols: dict[str, int] | None = None) -> int:
    if isinstance(t, TupleType):
        return sum(_nbytes(x, symbols) for x in t.items)
    return t.numel(symbols) * DTYPE_BYTES.get(t.dtype, 4)


def _io_bytes(ins: list[TensorType], out: ValueType, attrs: Attrs) -> Cost:
    return Cost(flops=0, bytes=sum(_nbytes(t) for t in ins) + _nbytes(out))


def _elementwise_cost(flops_per_elem: int) -> Callable[[list[TensorType], ValueType, Attrs], Cost]:
    def cost(ins: list[TensorType], out: ValueType, attrs: Attrs) -> Cost:
        o = out.items[0] if isinstance(out, TupleType) else out
        return Cost(flops=flops_per_elem * o.numel(), bytes=sum(_nbytes(t) for t in ins) + _nbytes(out))

    return cost


# ---------------------------------------------------------------- graph plumbing ops


register_op(OpDef("input", 0, 0, infer=lambda ins, a: a["type"], attrs={"name": REQUIRED, "type": REQUIRED},
                  doc="A graph input (the entry graph's token ids, a block's hidden state)."))
register_op(OpDef("param", 0, 0, infer=lambda ins, a: a["type"], attrs={"name": REQUIRED, "type": REQUIRED},
                  doc="A weight: `name` is a ParamSpec name of the program."))


def _infer_block(ins: list[TensorType], a: Attrs) -> ValueType:
    return ins[0]


register_op(OpDef("block", 1, 1, infer=_infer_block, attrs={"block": REQUIRED},
                  doc="Runs every layer of a repeated block, in order, on a hidden state."))


def _infer_getitem(ins: list[Any], a: Attrs) -> ValueType:
    (t,) = ins
    _check(isinstance(t, TupleType), "getitem reads a tuple-valued op")
    _check(0 <= a["index"] < len(t.items), f"getitem index {a['index']} out of range")
    return t.items[a["index"]]


register_op(OpDef("getitem", 1, 1, infer=_infer_getitem, reference=lambda ctx, t, index: t[index],
                  attrs={"index": REQUIRED}, doc="Element `index` of a tuple-valued op."))

# ---------------------------------------------------------------- model ops


def _infer_embedding(ins: list[TensorType], a: Attrs) -> TensorType:
    ids, table = ins
    _check(ids.rank == 1 and ids.dtype in ("i32", "i64"), f"embedding ids must be an int vector, got {ids}")
    _check(table.rank == 2, f"embedding table must be 2-D, got {table}")
    return TensorType((ids.shape[0], table.shape[1]), table.dtype)


register_op(OpDef(
    "embedding", 2, 2, infer=_infer_embedding,
    reference=lambda ctx, ids, table: F.embedding(ids.long(), table),
    cost=lambda ins, out, a: Cost(0, _nbytes(out) * 2 + _nbytes(ins[0])),
))


def _ref_rms_norm(ctx: RefContext, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _infer_rms_norm(ins: list[TensorType], a: Attrs) -> TensorType:
    x, w = ins
    _check(w.rank == 1 and _same(w.shape[0], x.shape[-1]), f"rms_norm weight {w} does not match input {x}")
    return x


register_op(OpDef("rms_norm", 2, 2, infer=_infer_rms_norm, reference=_ref_rms_norm,
                  cost=_elementwise_cost(4), attrs={"eps": 1e-6}))


def _infer_add_rms_norm(ins: list[TensorType], a: Attrs) -> TupleType:
    x, res, w = ins
    _check(x.shape == res.shape, f"add_rms_norm operands differ: {x} vs {res}")
    return TupleType((_infer_rms_norm([x, w], a), x))


def _ref_add_rms_norm(ctx: RefContext, x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float):
    s = x + res
    return (_ref_rms_norm(ctx, s, w, eps), s)


register_op(OpDef("add_rms_norm", 3, 3, infer=_infer_add_rms_norm, reference=_ref_add_rms_norm,
                  cost=_elementwise_cost(5), attrs={"eps": 1e-6},
                  doc="(rms_norm(x + residual), x + residual) in one pass over memory."))


def _infer_linear(ins: list[TensorType], a: Attrs) -> TensorType:
    x, w = ins[0], ins[1]
    _check(w.rank == 2, f"linear weight must be 2-D, got {w}")
    _check(_same(x.shape[-1], w.shape[1]), f"linear input {x} does not match weight {w} (in_features {w.shape[1]})")
    if len(ins) == 3:
        _check(ins[2].rank == 1 and _same(ins[2].shape[0], w.shape[0]), f"linear bias {ins[2]} vs weight {w}")
    return TensorType((*x.shape[:-1], w.shape[0]), x.dtype)


def _linear_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    x, w = ins[0], ins[1]
    rows = x.numel() // max(1, x.shape[-1]) if isinstance(x.shape[-1], int) else 1
    return Cost(2 * rows * w.numel(), sum(_nbytes(t) for t in ins) + _nbytes(out))


register_op(OpDef("linear", 2, 3, infer=_infer_linear,
                  reference=lambda ctx, x, w, b=None: F.linear(x, w, b), cost=_linear_cost,
                  doc="x @ w.T (+ b)."))


def _infer_lora(ins: list[TensorType], a: Attrs) -> TensorType:
    x, y = ins
    _check(len(a["modules"]) == len(a["rows"]) > 0, "lora: one row count per adapted module")
    if isinstance(y.shape[-1], int):
        _check(sum(a["rows"]) == y.shape[-1], f"lora: module rows {tuple(a['rows'])} do not add up to {y}")
    _check(x.shape[:-1] == y.shape[:-1], f"lora: input {x} and projection {y} differ in their leading dims")
    return y


def _lora_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    x, y = ins
    rows = x.numel() // max(1, x.shape[-1]) if isinstance(x.shape[-1], int) else 1
    rank = a["max_rank"] * len(a["modules"])
    k, n = x.shape[-1], y.shape[-1]
    flops = 2 * rows * rank * ((k if isinstance(k, int) else 0) + (n if isinstance(n, int) else 0))
    return Cost(flops, sum(_nbytes(t) for t in ins) + _nbytes(out))


register_op(OpDef("lora", 2, 2, infer=_infer_lora, reference=lambda ctx, x, y, **a: y, cost=_lora_cost,
                  attrs={"target": REQUIRED, "modules": REQUIRED, "rows": REQUIRED, "max_rank": REQUIRED},
                  doc="y + the low-rank delta of each token's adapter: for module j (rows[j] of y), "
                      "(x @ A_j.T) @ B_j.T * scaling_j. Adapter weights are run-time state (the runtime's slots, "
                      "read through the batch), so the reference is the base model's: y."))


def _infer_view(ins: list[TensorType], a: Attrs) -> TensorType:
    (x,) = ins
    shape = tuple(a["shape"])
    prod = math.prod(shape)
    _check(isinstance(x.shape[-1], int) and x.shape[-1] == prod,
           f"view{list(shape)} needs a last dim of {prod}, got {x}")
    return TensorType((*x.shape[:-1], *shape), x.dtype)


register_op(OpDef("view", 1, 1, infer=_infer_view, attrs={"shape": REQUIRED}, varargs_attr="shape",
                  reference=lambda ctx, x, shape: x.reshape(*x.shape[:-1], *shape),
                  cost=lambda ins, out, a: Cost(0, 0), doc="Splits the last dim into `shape`."))


def _infer_slice(ins: list[TensorType], a: Attrs) -> TensorType:
    (x,) = ins
    start, stop = a["start"], a["stop"]
    _check(isinstance(x.shape[-1], int) and 0 <= start < stop <= x.shape[-1],
           f"slice [{start}:{stop}] out of range for {x}")
    return TensorType((*x.shape[:-1], stop - start), x.dtype)


register_op(OpDef("slice", 1, 1, infer=_infer_slice, attrs={"start": REQUIRED, "stop": REQUIRED},
                  reference=lambda ctx, x, start, stop: x[..., start:stop],
                  cost=lambda ins, out, a: Cost(0, 0), doc="x[..., start:stop] (a view of a fused output)."))


def _yarn_inv_freq(head_dim: int, theta: float, factor: float, original_max_position: int,
                   beta_fast: float, beta_slow: float, truncate: bool) -> torch.Tensor:
    """YaRN frequencies (transformers' `_compute_yarn_parameters`): dims that turn fewer than `beta_slow` times
    over the original context are interpolated (divided by `factor`), dims that turn more than `beta_fast` times
    are kept, and a linear ramp blends the dims between."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: str, factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0,
                          attention_factor: float = 0.0, original_max_position: int = 0) -> float:
    """The factor on cos/sin: 1 except for yarn and longrope, where a given `attention_factor` wins. Else yarn
    takes DeepSeek's mscale/mscale_all_dim ratio when both are set, else yarn_get_mscale(factor); longrope takes
    sqrt(1 + ln(factor) / ln(original_max_position)) when factor > 1 (transformers' `_compute_longrope_parameters`,
    factor being the checkpoint's max_position_embeddings / original_max_position_embeddings), else 1.
    0 means "not given", as transformers treats a missing (or falsy) key."""
    if scaling not in ("yarn", "longrope"):
        return 1.0
    if attention_factor:
        return float(attention_factor)
    if scaling == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(original_max_position)) if factor > 1 else 1.0
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def longrope_factors(short_factor: Sequence[float], long_factor: Sequence[float], original_max_position: int,
                     seq_len: int) -> Sequence[float]:
    """LongRoPE's per-frequency divisors for a sequence of `seq_len` positions: `long_factor` beyond the original
    context, else `short_factor` (transformers' `_compute_longrope_parameters` with `dynamic_rope_update`'s
    seq_len = max(position_ids) + 1). The IR reference applies it to its one dense sequence; a generated model
    applies it once, to the longest sequence it serves (its MAX_MODEL_LEN): see docs/rope.md."""
    return long_factor if seq_len > original_max_position else short_factor


ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(head_dim: int, theta: float, scaling: str, factor: float, low_freq_factor: float,
                  high_freq_factor: float, original_max_position: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True,
                  longrope_factors: Sequence[float] = ()) -> torch.Tensor:
    """Inverse frequencies of RoPE over `head_dim` rotated dims (the rotary dim when partial), including Llama-3.1
    frequency-dependent scaling ("llama3"), YaRN, and LongRoPE (each frequency divided by its entry of
    `longrope_factors`, the short or the long set: see `longrope_factors`)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling == "longrope":  # transformers' op order, so fp32 tables are bit-identical
        return 1.0 / (torch.tensor(longrope_factors, dtype=torch.float32) * theta ** exponents)
    inv = 1.0 / (theta ** exponents)
    if scaling == "llama3":
        low_wavelen = original_max_position / low_freq_factor
        high_wavelen = original_max_position / high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif scaling == "linear":
        inv = inv / factor
    elif scaling == "yarn":
        inv = _yarn_inv_freq(head_dim, theta, factor, original_max_position, beta_fast, beta_slow, truncate)
    elif scaling != "none":
        raise ValueError(f"unknown rope scaling {scaling!r} (known: {', '.join(ROPE_SCALINGS)})")
    return inv


# yarn's mscale, mscale_all_dim and attention_factor: 0 = not given (see rope_attention_factor).
# rotary_dim: how many leading dims of each head rotate (partial rotary, Phi-4-mini: 3/4 of the head), 0 = all.
# short_factor / long_factor: LongRoPE's per-frequency divisors (rotary_dim / 2 each), scaling="longrope" only.
ROPE_ATTRS = {"theta": 10000.0, "scaling": "none", "factor": 1.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
              "mscale": 0.0, "mscale_all_dim": 0.0, "attention_factor": 0.0, "truncate": True,
              "rotary_dim": 0, "short_factor": (), "long_factor": ()}


def _ref_rope(ctx: RefContext, x: torch.Tensor, **a: Any) -> torch.Tensor:
    d = x.shape[-1]
    r = a["rotary_dim"] or d
    ext: Sequence[float] = ()
    if a["scaling"] == "longrope":
        seq_len = int(ctx.positions.max()) + 1 if ctx.positions.numel() else 0
        ext = longrope_factors(a["short_factor"], a["long_factor"], a["original_max_position"], seq_len)
    inv = rope_inv_freq(r, a["theta"], a["scaling"], a["factor"], a["low_freq_factor"], a["high_freq_factor"],
                        a["original_max_position"], a["beta_fast"], a["beta_slow"], a["truncate"], ext)
    ang = ctx.positions.float()[:, None] * inv[None, :]  # [T, r/2]
    emb = torch.cat([ang, ang], dim=-1)
    mag = rope_attention_factor(a["scaling"], a["factor"], a["mscale"], a["mscale_all_dim"], a["attention_factor"],
                                a["original_max_position"])
    cos, sin = (emb.cos() * mag)[:, None, :].to(x.dtype), (emb.sin() * mag)[:, None, :].to(x.dtype)
    xr = x[..., :r]  # partial rotary: HF's rotate_half over the first r dims, the rest passes through
    rot = torch.cat([-xr[..., r // 2:], xr[..., : r // 2]], dim=-1)
    return torch.cat([xr * cos + rot * sin, x[..., r:]], dim=-1)


def _infer_rope(ins: list[TensorType], a: Attrs) -> TensorType:
    (x,) = ins
    _check(x.rank == 3 and isinstance(x.shape[-1], int) and x.shape[-1] % 2 == 0,
           f"rope expects [T, heads, head_dim] with an even head_dim, got {x}")
    head_dim = x.shape[-1]
    scalings = layer_values(a.get("scaling", ROPE_ATTRS["scaling"]))  # per layer (Gemma 3's local/global)
    for scaling in scalings:
        _check(scaling in ROPE_SCALINGS, f"unknown rope scaling {scaling!r} (known: {', '.join(ROPE_SCALINGS)})")
    for rotary_dim in layer_values(a.get("rotary_dim", 0)):
        _check(isinstance(rotary_dim, int) and not isinstance(rotary_dim, bool) and 0 <= rotary_dim <= head_dim
               and rotary_dim % 2 == 0,
               f"rope rotary_dim must be an even number of dims <= head_dim {head_dim} (0: all), got {rotary_dim!r}")
    if "longrope" in scalings:  # its attention factor divides by ln(original_max_position)
        for original in layer_values(a.get("original_max_position", ROPE_ATTRS["original_max_position"])):
            _check(original > 1, f"longrope needs original_max_position > 1, got {original!r}")
    for key in ("short_factor", "long_factor"):
        for factors in layer_values(a.get(key, ())):
            if "longrope" not in scalings:
                _check(not factors, f"rope {key} is LongRoPE's; scaling is {' / '.join(map(repr, scalings))}")
                continue
            for rotary_dim in layer_values(a.get("rotary_dim", 0)):
                pairs = (rotary_dim or head_dim) // 2
                _check(isinstance(factors, tuple) and len(factors) == pairs,
                       f"longrope {key} needs one factor per rotated dim pair ({pairs}), got "
                       f"{len(factors) if isinstance(factors, tuple) else factors!r}")
            _check(all(isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                       for f in factors), f"longrope {key} must be positive finite numbers, got {list(factors)}")
    return x


register_op(OpDef("rope", 1, 1, infer=_infer_rope, reference=_ref_rope, cost=_elementwise_cost(6),
                  attrs=dict(ROPE_ATTRS), per_tensor=True,
                  doc="Rotary position embedding (rotate-half convention) at the step's positions, over the first "
                      "rotary_dim dims of each head (0: all; the rest pass through). scaling='longrope' divides "
                      "each frequency by short_factor, or by long_factor for a sequence longer than "
                      "original_max_position (the reference's one sequence; a generated model decides once, from "
                      "its MAX_MODEL_LEN: docs/rope.md)."))


def attention_sinks(num_inputs: int, attrs: Attrs) -> int | None:
    """The input index of an attention's per-head sink logits (gpt-oss), None without: inputs are q, k, v, then
    k_scale, v_scale when kv_dtype is set, then the sinks when given."""
    plain = 5 if attrs.get("kv_dtype") else 3
    return plain if num_inputs == plain + 1 else None


def _infer_attention(ins: list[TensorType], a: Attrs) -> TensorType:
    q, k, v = ins[:3]
    plain = 5 if a.get("kv_dtype") else 3
    _check(len(ins) in (plain, plain + 1),
           f"attention takes q, k, v (and k_scale, v_scale with kv_dtype set), then optional sinks, got {len(ins)} "
           "inputs")
    sinks = attention_sinks(len(ins), a)
    if sinks is not None:
        s = ins[sinks]
        _check(s.rank == 1 and _same(s.shape[0], q.shape[1]),
               f"attention sinks must be one logit per query head [{q.shape[1]}], got {s}")
    if a.get("kv_dtype"):
        _check(a["kv_dtype"] == "fp8e4m3", f"attention kv_dtype={a['kv_dtype']!r}; only fp8e4m3 is supported")
        for s in ins[3:5]:
            _check(s.shape == (k.shape[1],) and s.dtype == "f32", f"KV scales must be f32[{k.shape[1]}] (per kv head), got {s}")
    _check(q.rank == 3 and k.rank == 3 and v.rank == 3, f"attention expects [T, heads, head_dim], got {q}, {k}, {v}")
    if a.get("rope") is not None:  # fuse_rope_kv_write: q and k arrive un-roped
        _check(not a.get("kv_dtype"), "attention with a fused rope takes no fp8 KV cache (KV-scale calibration "
               "observes the attention's k, which must already be roped): fuse rope after quantize_kv_cache")
        _infer_rope([q], a["rope"])  # the absorbed rope's own checks (even head_dim, known scaling)
    for cap in layer_values(a.get("softcap", 0.0)):
        _check(isinstance(cap, int | float) and not isinstance(cap, bool) and cap >= 0,
               f"attention softcap must be a number >= 0 (0: none), got {cap!r}")
    _check(k.shape == v.shape, f"attention k {k} and v {v} differ")
    _check(_same(q.shape[2], k.shape[2]), f"attention head_dim differs: q {q}, k {k}")
    hq, hk = q.shape[1], k.shape[1]
    _check(isinstance(hq, int) and isinstance(hk, int) and hq % hk == 0,
           f"attention query heads {hq} must be a multiple of kv heads {hk}")
    return TensorType((q.shape[0], hq * q.shape[2]), q.dtype)


def _ref_attention(ctx: RefContext, q, k, v, *extra, sliding_window: int = 0,
                   scale: float | None = None, kv_dtype: str | None = None, rope: Attrs | None = None,
                   softcap: float = 0.0):
    k_scale, v_scale = extra[:2] if kv_dtype is not None else (None, None)
    sinks = extra[-1] if len(extra) == (3 if kv_dtype is not None else 1) else None
    if rope is not None:  # the rope it absorbed (fuse_rope_kv_write), with the rope op's own attributes
        rope_attrs = {**{k_: d for k_, d in OPS["rope"].attrs.items() if d is not REQUIRED}, **rope}
        q, k = _ref_rope(ctx, q, **rope_attrs), _ref_rope(ctx, k, **rope_attrs)
    if kv_dtype is not None:  # the cache holds K/V rounded through e4m3 with one scale per KV head
        from kiln.compiler.quant import fp8_fake_quantize

        k, v = fp8_fake_quantize(k, k_scale, dim=1), fp8_fake_quantize(v, v_scale, dim=1)
    t, hq, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = d ** -0.5 if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:  # Gemma 2: scores capped to (-softcap, softcap) before the mask and softmax
        s = torch.tanh(s / softcap) * softcap
    pos = ctx.positions.long()
    mask = pos[None, :] <= pos[:, None]
    if sliding_window:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    s = s.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:  # gpt-oss: one more logit per head in the softmax's denominator, attending to nothing
        sink = sinks.float()[:, None, None].expand(hq, t, 1)
        p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    o = torch.einsum("hqk,khd->qhd", p, v.float()).to(q.dtype)
    return o.reshape(t, hq * d)


def _attention_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    q, k, _ = ins[:3]
    rope_flops = 6 * (q.numel() + k.numel()) if a.get("rope") is not None else 0
    return Cost(4 * q.numel() + rope_flops, sum(_nbytes(t) for t in ins) + _nbytes(out))  # per token of context; see report


register_op(OpDef("attention", 3, 6, infer=_infer_attention, reference=_ref_attention, cost=_attention_cost,
                  attrs={"sliding_window": 0, "scale": None, "kv_dtype": None, "rope": None, "softcap": 0.0},
                  doc="Causal attention over this step's tokens and the sequence's cached K/V (GQA). "
                      "softcap > 0 caps the scaled scores to softcap·tanh(s / softcap) (Gemma 2). A last input "
                      "`sinks` [heads] (gpt-oss) adds exp(sinks[h]) to head h's softmax denominator: a learned "
                      "logit that takes probability mass and contributes no value. With "
                      "kv_dtype='fp8e4m3' the cache stores K/V in e4m3 with per-KV-head scales (inputs 4, 5). "
                      "With rope={rope attributes} (fuse_rope_kv_write) q and k arrive un-roped and are rotated "
                      "as rope(x, **rope) would, before k is cached: one kernel ropes q/k and writes K/V."))


def _infer_unary(ins: list[TensorType], a: Attrs) -> TensorType:
    return ins[0]


register_op(OpDef("silu", 1, 1, infer=_infer_unary, reference=lambda ctx, x: F.silu(x), cost=_elementwise_cost(4)))
register_op(OpDef("gelu_tanh", 1, 1, infer=_infer_unary, cost=_elementwise_cost(8),
                  reference=lambda ctx, x: F.gelu(x, approximate="tanh"),
                  doc="GELU with the tanh approximation (HF `gelu_pytorch_tanh`: Gemma's MLP activation)."))


def _infer_scaled(ins: list[TensorType], a: Attrs) -> TensorType:
    _check(isinstance(a.get("factor"), int | float) and not isinstance(a.get("factor"), bool),
           f"scale factor must be a number, got {a.get('factor')!r}")
    return ins[0]


def _ref_scale(ctx: RefContext, x: torch.Tensor, factor: float) -> torch.Tensor:
    # the factor in x's dtype first, as HF Gemma's embedding scale (`embed_scale.to(weight.dtype)`)
    return x * torch.tensor(factor, dtype=x.dtype)


register_op(OpDef("scale", 1, 1, infer=_infer_scaled, reference=_ref_scale, cost=_elementwise_cost(1),
                  attrs={"factor": REQUIRED},
                  doc="x * factor, the factor rounded to x's dtype first (Gemma's embeddings times sqrt(hidden))."))


def _infer_softcap(ins: list[TensorType], a: Attrs) -> TensorType:
    cap = a.get("cap")
    _check(isinstance(cap, int | float) and not isinstance(cap, bool) and cap > 0,
           f"softcap cap must be a positive number, got {cap!r}")
    return ins[0]


register_op(OpDef("softcap", 1, 1, infer=_infer_softcap, cost=_elementwise_cost(3), attrs={"cap": REQUIRED},
                  reference=lambda ctx, x, cap: torch.tanh(x / cap) * cap,
                  doc="cap * tanh(x / cap): Gemma 2's final-logit soft-capping."))


def _infer_silu_mul(ins: list[TensorType], a: Attrs) -> TensorType:
    (x,) = ins
    _check(isinstance(x.shape[-1], int) and x.shape[-1] % 2 == 0, f"silu_mul needs an even last dim, got {x}")
    return TensorType((*x.shape[:-1], x.shape[-1] // 2), x.dtype)


def _ref_silu_mul(ctx: RefContext, x: torch.Tensor) -> torch.Tensor:
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


register_op(OpDef("silu_mul", 1, 1, infer=_infer_silu_mul, reference=_ref_silu_mul, cost=_elementwise_cost(5),
                  doc="silu(x[..., :F]) * x[..., F:] for a fused gate/up output."))


def _infer_binary(ins: list[TensorType], a: Attrs) -> TensorType:
    x, y = ins
    _check(x.shape == y.shape, f"operands differ in shape: {x} vs {y}")
    _check(x.dtype == y.dtype, f"operands differ in dtype: {x} vs {y}")
    return x


register_op(OpDef("add", 2, 2, infer=_infer_binary, reference=lambda ctx, x, y: x + y, cost=_elementwise_cost(1)))


def _infer_bias_add(ins: list[TensorType], a: Attrs) -> TensorType:
    x, b = ins
    _check(b.rank == 1 and _same(b.shape[0], x.shape[-1]), f"bias_add needs a bias [last dim of {x}], got {b}")
    _check(x.dtype == b.dtype, f"operands differ in dtype: {x} vs {b}")
    return x


register_op(OpDef("bias_add", 2, 2, infer=_infer_bias_add, reference=lambda ctx, x, b: x + b,
                  cost=_elementwise_cost(1),
                  doc="x + b, b broadcast over the rows: a row-parallel linear's bias, added once after its reduction."))
register_op(OpDef("mul", 2, 2, infer=_infer_binary, reference=lambda ctx, x, y: x * y, cost=_elementwise_cost(1)))


def _infer_concat(ins: list[TensorType], a: Attrs) -> TensorType:
    x, y = ins
    _check(x.rank == y.rank and all(_same(p, q) for p, q in zip(x.shape[:-1], y.shape[:-1], strict=True)),
           f"concat operands differ in leading dims: {x} vs {y}")
    _check(x.dtype == y.dtype, f"concat operands differ in dtype: {x} vs {y}")
    last = x.shape[-1] + y.shape[-1] if isinstance(x.shape[-1], int) and isinstance(y.shape[-1], int) else "?"
    _check(last != "?", f"concat needs static last dims, got {x} and {y}")
    return TensorType((*x.shape[:-1], last), x.dtype)


register_op(OpDef("concat", 2, 2, infer=_infer_concat, reference=lambda ctx, x, y: torch.cat((x, y), dim=-1),
                  cost=_io_bytes, doc="[x | y] along the last dim (DeepSeek MTP joins embedding and hidden state)."))


def _infer_logits(ins: list[TensorType], a: Attrs) -> TensorType:
    x, w = ins
    _check(w.rank == 2 and _same(x.shape[-1], w.shape[1]), f"logits weight {w} does not match hidden {x}")
    return TensorType((x.shape[0], w.shape[0]), "f32")


register_op(OpDef("logits", 2, 2, infer=_infer_logits,
                  reference=lambda ctx, x, w: F.linear(x, w).float(), cost=_linear_cost,
                  doc="fp32 logits of the rows the runtime asks for (all rows in the reference)."))


def _infer_hidden_rows(ins: list[TensorType], a: Attrs) -> TensorType:
    (x,) = ins
    _check(x.rank == 2, f"hidden_rows needs [tokens, hidden], got {x}")
    return TensorType((x.shape[0], x.shape[1]), "f32")


register_op(OpDef("hidden_rows", 1, 1, infer=_infer_hidden_rows, reference=lambda ctx, x: x.float(),
                  cost=_io_bytes, doc="fp32 hidden states of the rows the runtime asks for (an embedding "
                  "model's output in place of logits; all rows in the reference)."))


# ---------------------------------------------------------------- multi-head latent attention (DeepSeek-V2/V3)


def _infer_deinterleave(ins: list[TensorType], a: Attrs) -> TensorType:
    (x,) = ins
    _check(isinstance(x.shape[-1], int) and x.shape[-1] % 2 == 0, f"deinterleave needs an even last dim, got {x}")
    return x


register_op(OpDef("deinterleave", 1, 1, infer=_infer_deinterleave,
                  reference=lambda ctx, x: torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1),
                  cost=_elementwise_cost(0),
                  doc="Rotary pairs (x0, x1), (x2, x3), ... laid out as halves [x0, x2, ... | x1, x3, ...]: "
                      "interleaved rope (DeepSeek `rope_interleave`) is rope(deinterleave(x))."))

MLA_ABSORB = ("none", "decode")


def _mla_dims(ins: list[TensorType]) -> tuple[int, int, int, int, int]:
    """(heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim) of an mla_attention's inputs."""
    q_nope, q_pe, c_kv, k_pe, w_kv_b = ins[:5]
    _check(q_nope.rank == 3 and q_pe.rank == 3 and q_nope.shape[:2] == q_pe.shape[:2],
           f"mla_attention q_nope {q_nope} and q_pe {q_pe} must be [T, heads, dim] alike")
    _check(c_kv.rank == 2 and _same(c_kv.shape[0], q_nope.shape[0]), f"mla_attention c_kv {c_kv} must be [T, kv_lora_rank]")
    _check(k_pe.rank == 3 and k_pe.shape[1] == 1 and _same(k_pe.shape[2], q_pe.shape[2]),
           f"mla_attention k_pe {k_pe} must be [T, 1, qk_rope_head_dim] (one rope key shared by all heads), q_pe {q_pe}")
    heads, dn, dr, lora = q_nope.shape[1], q_nope.shape[2], q_pe.shape[2], c_kv.shape[1]
    _check(all(isinstance(d, int) for d in (heads, dn, dr, lora)), "mla_attention needs static head dims")
    _check(w_kv_b.rank == 2 and _same(w_kv_b.shape[1], lora) and isinstance(w_kv_b.shape[0], int)
           and w_kv_b.shape[0] % heads == 0 and w_kv_b.shape[0] // heads > dn,
           f"mla_attention w_kv_b {w_kv_b} must be [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] "
           f"with heads={heads}, qk_nope_head_dim={dn}, kv_lora_rank={lora}")
    return heads, dn, dr, lora, w_kv_b.shape[0] // heads - dn


def _infer_mla_attention(ins: list[TensorType], a: Attrs) -> TensorType:
    heads, _, _, _, dv = _mla_dims(ins)
    _check(a.get("absorb", "none") in MLA_ABSORB, f"mla_attention absorb={a.get('absorb')!r}; expected one of {MLA_ABSORB}")
    _check(len(ins) == (6 if a.get("kv_dtype") else 5),
           f"mla_attention takes q_nope, q_pe, c_kv, k_pe, w_kv_b (and kv_scale with kv_dtype set), got {len(ins)} inputs")
    if a.get("kv_dtype"):
        _check(a["kv_dtype"] == "fp8e4m3", f"mla_attention kv_dtype={a['kv_dtype']!r}; only fp8e4m3 is supported")
        _check(ins[5].shape == (1,) and ins[5].dtype == "f32",
               f"the MLA latent cache's scale must be f32[1] (one per layer), got {ins[5]}")
    return TensorType((ins[0].shape[0], heads * dv), ins[0].dtype)


def _ref_mla_attention(ctx: RefContext, q_nope, q_pe, c_kv, k_pe, w_kv_b, kv_scale=None, scale: float | None = None,
                       absorb: str = "none", kv_dtype: str | None = None):
    if kv_dtype is not None:  # the cache holds the latent row [c_kv | k_pe] rounded through e4m3, one scale
        from kiln.compiler.quant import fp8_fake_quantize

        c_kv, k_pe = fp8_fake_quantize(c_kv, kv_scale, dim=0), fp8_fake_quantize(k_pe, kv_scale, dim=0)
    t, heads, dn = q_nope.shape
    dr, lora = q_pe.shape[2], c_kv.shape[1]
    scale = (dn + dr) ** -0.5 if scale is None else scale
    w = w_kv_b.float().view(heads, -1, lora)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, L], [H, dv, L]
    pos = ctx.positions.long()
    mask = pos[None, :] <= pos[:, None]
    rope_scores = torch.einsum("qhr,kr->hqk", q_pe.float(), k_pe[:, 0].float())
    if absorb == "decode":  # the reference absorbs every query: same meaning, the decode kernel's arithmetic
        q_lat = torch.einsum("qhd,hdl->qhl", q_nope.float(), w_uk)
        s = (torch.einsum("qhl,kl->hqk", q_lat, c_kv.float()) + rope_scores) * scale
        p = s.masked_fill(~mask[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,kl,hvl->qhv", p, c_kv.float(), w_uv)
    else:  # expand per-head keys and values from the latent
        k_nope = torch.einsum("kl,hdl->khd", c_kv.float(), w_uk)
        v = torch.einsum("kl,hvl->khv", c_kv.float(), w_uv)
        s = (torch.einsum("qhd,khd->hqk", q_nope.float(), k_nope) + rope_scores) * scale
        p = s.masked_fill(~mask[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khv->qhv", p, v)
    return o.to(q_nope.dtype).reshape(t, -1)


def _mla_attention_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    heads, dn, dr, lora, dv = _mla_dims(ins)
    t = ins[0].numel() // (heads * dn)
    if a.get("absorb", "none") == "decode":  # q_nope·W_UK, one latent "head" of width L + dr, ·W_UV
        flops = t * heads * (2 * dn * lora + 4 * (lora + dr) + 2 * lora * dv)
    else:
        flops = t * heads * (2 * lora * (dn + dv) + 2 * (dn + dr) + 2 * dv)
    return Cost(flops, sum(_nbytes(x) for x in ins) + _nbytes(out))  # per token of context; see report


register_op(OpDef("mla_attention", 5, 6, infer=_infer_mla_attention, reference=_ref_mla_attention,
                  cost=_mla_attention_cost, attrs={"scale": None, "absorb": "none", "kv_dtype": None},
                  doc="Multi-head latent attention (DeepSeek-V2/V3): q_nope [T, H, dn], q_pe [T, H, dr] (roped), "
                      "c_kv [T, L] (normed latent), k_pe [T, 1, dr] (roped), w_kv_b [H*(dn+dv), L] -> [T, H*dv]. "
                      "Only [c_kv | k_pe] is cached. absorb='decode': decode queries run in latent space "
                      "(q_nope·W_UK, ·W_UV on the output); prefills expand K/V from the latent. With "
                      "kv_dtype='fp8e4m3' the latent is cached in e4m3 with one per-layer scale (input 6)."))


# ---------------------------------------------------------------- quantized weights (fp8, int4 weight-only)
#
# A quantized weight is several params (the packed/fp8 tensor and its scales) that a dequant op turns back
# into the [N, K] float weight a `linear` reads; `fuse_dequant_linear` then fuses each dequant into its GEMM
# (linear_fp8, linear_w4a16). Numerics: kiln.compiler.quant.

FP8_ACTS = ("none", "dynamic_per_token", "static_per_tensor")


def _infer_fp8_weight(w: TensorType, scale: TensorType, a: Attrs) -> None:
    _check(w.rank == 2 and w.dtype == "fp8e4m3", f"fp8 weight must be fp8e4m3[N, K], got {w}")
    n, k = w.shape
    g, block = a.get("granularity", "tensor"), a.get("block", 0)
    want = {"tensor": (1,), "channel": (n,),
            "block": (-(-n // block), -(-k // block)) if isinstance(block, int) and block > 0 else None}.get(g)
    _check(want is not None, f"fp8 granularity {g!r} (block={block}) is not one of tensor, channel, block=B")
    _check(scale.shape == want and scale.dtype == "f32", f"fp8 {g} scale must be f32{list(want)} for {w}, got {scale}")


def _infer_dequant_fp8(ins: list[TensorType], a: Attrs) -> TensorType:
    w, scale = ins
    _infer_fp8_weight(w, scale, a)
    return TensorType(w.shape, a["dtype"])


def _ref_dequant_fp8(ctx: RefContext, w, scale, granularity: str, block: int, dtype: str):
    from kiln.compiler.quant import fp8_dequantize

    return fp8_dequantize(w, scale, block if granularity == "block" else 0).to(_TORCH_FLOAT[dtype])


_TORCH_FLOAT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
register_op(OpDef("dequant_fp8", 2, 2, infer=_infer_dequant_fp8, reference=_ref_dequant_fp8, cost=_io_bytes,
                  attrs={"granularity": "tensor", "block": 0, "dtype": REQUIRED},
                  doc="fp8e4m3 weight [N, K] x scale (tensor [1], channel [N], block [ceil(N/B), ceil(K/B)]) "
                      "-> float weight [N, K] of `dtype`."))


def _int4_shapes(ins: list[TensorType], a: Attrs) -> tuple[int, int]:
    """(N, K) of an int4 weight from its packed params; checks the published layout's shapes."""
    fmt, group = a.get("format"), a.get("group")
    _check(fmt in ("awq", "gptq"), f"int4 format {fmt!r} is not awq or gptq")
    qweight, qzeros, scales = ins[:3]
    _check(qweight.dtype == "i32" and qzeros.dtype == "i32", f"int4 qweight/qzeros must be i32, got {qweight}, {qzeros}")
    if fmt == "awq":
        k, n = qweight.shape[0], qweight.shape[1] * 8
    else:
        k, n = qweight.shape[0] * 8, qweight.shape[1]
    _check(isinstance(group, int) and group > 0 and k % group == 0, f"int4 group {group} must divide K={k}")
    _check(qzeros.shape == (k // group, n // 8), f"{fmt} qzeros must be i32[{k // group}, {n // 8}], got {qzeros}")
    _check(scales.shape == (k // group, n), f"{fmt} scales must be [{k // group}, {n}], got {scales}")
    if fmt == "gptq":
        _check(len(ins) > 3 and ins[3].shape == (k,) and ins[3].dtype == "i32", f"gptq needs g_idx i32[{k}]")
    return n, k


def _infer_dequant_int4(ins: list[TensorType], a: Attrs) -> TensorType:
    n, k = _int4_shapes(ins, a)
    _check(len(ins) == (4 if a["format"] == "gptq" else 3), f"dequant_int4 {a['format']} takes {len(ins)} inputs")
    return TensorType((n, k), a["dtype"])


def _ref_dequant_int4(ctx: RefContext, qweight, qzeros, scales, g_idx=None, *, format: str, group: int,
                      zero_offset: int, dtype: str):
    from kiln.compiler.quant import dequant_awq, dequant_gptq

    w = (dequant_awq(qweight, qzeros, scales, group) if format == "awq"
         else dequant_gptq(qweight, qzeros, scales, g_idx, zero_offset))
    return w.to(_TORCH_FLOAT[dtype])


register_op(OpDef("dequant_int4", 3, 4, infer=_infer_dequant_int4, reference=_ref_dequant_int4, cost=_io_bytes,
                  attrs={"format": REQUIRED, "group": 128, "zero_offset": 1, "dtype": REQUIRED},
                  doc="Packed int4 weight as published -> float [N, K]. awq: (qweight [K, N/8], qzeros [K/g, N/8], "
                      "scales [K/g, N]); gptq: (qweight [K/8, N], qzeros, scales, g_idx [K]), zero + zero_offset."))


def _infer_linear_fp8(ins: list[TensorType], a: Attrs) -> TensorType:
    x, w, scale = ins[:3]
    _infer_fp8_weight(w, scale, a)
    act = a.get("act", "none")
    _check(act in FP8_ACTS, f"linear_fp8 act={act!r}; expected one of {FP8_ACTS}")
    rest = ins[3:]
    if act == "static_per_tensor":
        _check(a.get("granularity", "tensor") != "block", "linear_fp8 act='static_per_tensor' takes tensor or "
               "channel weight scales, not block")
        _check(len(rest) >= 1 and rest[0].shape == (1,) and rest[0].dtype == "f32",
               f"linear_fp8 act='static_per_tensor' needs the input scale f32[1] as input 3, got {rest[:1]}")
        rest = rest[1:]
    _check(len(rest) <= 1, f"linear_fp8 act={act!r} takes x, w_q, scale, "
           f"{'x_scale, ' if act == 'static_per_tensor' else ''}[bias]; got {len(ins)} inputs")
    return _infer_linear([x, TensorType(w.shape, x.dtype), *rest], a)


def _ref_linear_fp8(ctx: RefContext, x, w, scale, *rest, granularity: str, block: int, act: str):
    from kiln.compiler.quant import fp8_dequantize, fp8_scaled_matmul, fp8_static_matmul

    block = block if granularity == "block" else 0
    if act == "static_per_tensor":
        x_scale, bias = rest[0], (rest[1] if len(rest) > 1 else None)
        y = fp8_static_matmul(x.reshape(-1, x.shape[-1]), w, scale, x_scale).to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    bias = rest[0] if rest else None
    if act == "dynamic_per_token":
        y = fp8_scaled_matmul(x.reshape(-1, x.shape[-1]), w, scale, block).to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    return F.linear(x, fp8_dequantize(w, scale, block).to(x.dtype), bias)


register_op(OpDef("linear_fp8", 3, 5, infer=_infer_linear_fp8, reference=_ref_linear_fp8, cost=_linear_cost,
                  attrs={"granularity": "tensor", "block": 0, "act": "none"},
                  doc="x @ dequant(w_q, scale).T (+ b). act='dynamic_per_token' also quantizes x to e4m3 per "
                      "token (per token and B columns for block scales) and multiplies in fp8, as torch._scaled_mm. "
                      "act='static_per_tensor' (inputs x, w_q, scale, x_scale[1], [b]) quantizes x with the "
                      "calibrated x_scale instead (compressed-tensors static W8A8)."))


def _infer_linear_w4a16(ins: list[TensorType], a: Attrs) -> TensorType:
    x, rest = ins[0], ins[1:]
    n, k = _int4_shapes(rest, a)
    packed = 4 if a["format"] == "gptq" else 3
    _check(len(rest) in (packed, packed + 1), f"linear_w4a16 {a['format']} takes x, {packed} weight params, [bias]")
    return _infer_linear([x, TensorType((n, k), x.dtype), *rest[packed:]], a)


def _ref_linear_w4a16(ctx: RefContext, x, *ins, format: str, group: int, zero_offset: int):
    packed = 4 if format == "gptq" else 3
    w = _ref_dequant_int4(ctx, *ins[:packed], format=format, group=group, zero_offset=zero_offset, dtype="f32")
    return F.linear(x, w.to(x.dtype), ins[packed] if len(ins) > packed else None)


def _int4_linear_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    x = ins[0]
    n, k = _int4_shapes(ins[1:], a)
    rows = x.numel() // max(1, x.shape[-1]) if isinstance(x.shape[-1], int) else 1
    return Cost(2 * rows * n * k, sum(_nbytes(t) for t in ins) + _nbytes(out))


register_op(OpDef("linear_w4a16", 4, 6, infer=_infer_linear_w4a16, reference=_ref_linear_w4a16,
                  cost=_int4_linear_cost, attrs={"format": REQUIRED, "group": 128, "zero_offset": 1},
                  doc="x @ dequant_int4(...).T (+ b): weights int4 (AWQ or GPTQ layout), activations 16/32-bit. "
                      "Inputs: x, the format's packed params (dequant_int4's), then an optional bias."))

def infer(op: str, ins: Sequence[ValueType], attrs: Attrs) -> ValueType:
    return OPS[op].infer(list(ins), attrs)


# ---------------------------------------------------------------- mixture of experts
#
# Routing contract (one for every router and every consumer): a router returns
# (weights f32 [T, top_k], ids i32 [T, top_k]). The verifier holds IR values to exactly these dtypes, so a
# router whose ids are typed i64, or a float "ids" value, is rejected at compile time. At run time, the
# references and kernels accept int32 *and* int64 ids from any caller (an i64 tensor from torch.topk, an
# i32 one from a fused router kernel) and index with `.long()` themselves: the dtype that reaches an
# indexing op is never the caller's problem.

MOE_IDS_DTYPE = "i32"
MOE_WEIGHTS_DTYPE = "f32"


def _infer_moe_router(ins: list[TensorType], a: Attrs) -> TupleType:
    logits = ins[0]
    _check(logits.rank == 2 and isinstance(logits.shape[1], int), f"router logits must be [T, experts], got {logits}")
    experts, top_k = logits.shape[1], a["top_k"]
    _check(isinstance(top_k, int) and 0 < top_k <= experts, f"top_k={top_k} must be in 1..{experts} (experts)")
    if len(ins) == 2:
        bias = ins[1]
        _check(bias.rank == 1 and bias.shape[0] == experts, f"router correction bias {bias} must be [{experts}]")
    t = logits.shape[0]
    return TupleType((TensorType((t, top_k), MOE_WEIGHTS_DTYPE), TensorType((t, top_k), MOE_IDS_DTYPE)))


def _infer_moe_grouped(ins: list[TensorType], a: Attrs) -> TupleType:
    out = _infer_moe_router(ins, a)
    experts, top_k = ins[0].shape[1], a["top_k"]
    n_group, topk_group = a.get("n_group", 1), a.get("topk_group", 1)
    _check(isinstance(n_group, int) and n_group > 0 and experts % n_group == 0,
           f"{experts} experts do not split into n_group={n_group}")
    _check(isinstance(topk_group, int) and 0 < topk_group <= n_group,
           f"topk_group={topk_group} must be in 1..n_group={n_group}")
    _check(top_k <= topk_group * (experts // n_group),
           f"top_k={top_k} exceeds the {topk_group} groups x {experts // n_group} experts it may choose from")
    _check(a.get("scoring", "sigmoid") in ("sigmoid", "softmax"), f"unknown scoring {a.get('scoring')!r}")
    _check(a.get("group_score", "top2_sum") in ("top2_sum", "max"), f"unknown group_score {a.get('group_score')!r}")
    return out


def _ref_moe_topk_softmax(ctx: RefContext | None, logits: torch.Tensor, top_k: int, renormalize: bool = True):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _router_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    return Cost(flops=8 * ins[0].numel(), bytes=sum(_nbytes(t) for t in ins) + _nbytes(out))


register_op(OpDef(
    "moe_topk_softmax", 1, 1, infer=_infer_moe_router, reference=_ref_moe_topk_softmax, cost=_router_cost,
    attrs={"top_k": REQUIRED, "renormalize": True},
    doc="Mixtral/Qwen-MoE router: softmax over experts (fp32), top_k, optionally renormalised to sum 1. "
        "Returns (weights f32 [T, k], ids i32 [T, k])."))


def _ref_moe_topk_grouped(ctx: RefContext | None, logits: torch.Tensor, bias: torch.Tensor | None = None, *,
                          top_k: int, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
                          renormalize: bool = False, scoring: str = "sigmoid", group_score: str = "top2_sum"):
    num_tokens, experts = logits.shape
    logits = logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, experts // n_group)
        if group_score == "top2_sum":
            gscore = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(dim=-1)
        else:
            gscore = grouped.max(dim=-1).values
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand(-1, -1, experts // n_group).reshape(num_tokens, experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # the correction bias steers selection only, never the weights
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling, ids.to(torch.int32)


register_op(OpDef(
    "moe_topk_grouped", 1, 2, infer=_infer_moe_grouped, reference=_ref_moe_topk_grouped, cost=_router_cost,
    attrs={"top_k": REQUIRED, "n_group": 1, "topk_group": 1, "routed_scaling": 1.0, "renormalize": False,
           "scoring": "sigmoid", "group_score": "top2_sum"},
    doc="DeepSeek router. scores = sigmoid (V3) or softmax (V2) of fp32 logits; selection uses scores + the "
        "optional correction bias [E], restricted to the best `topk_group` of `n_group` expert groups (group "
        "score: sum of its top-2 (V3) or its max (V2 group_limited_greedy); n_group=1 is plain greedy top-k); "
        "weights are the unbiased scores of the chosen experts, renormalised if asked, times routed_scaling. "
        "Returns (weights f32 [T, k], ids i32 [T, k])."))


EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


def split_expert_inputs(inputs: Sequence[Any], types: Sequence[TensorType]) -> tuple[list[Any], list[Any]]:
    """A moe_experts' weight inputs (after x, weights, ids) as (matrices, biases): the 3-D stacks, then the 2-D
    per-expert biases of a fused gate_up and of down, when given."""
    mats = [i for i, t in zip(inputs, types, strict=True) if t.rank == 3]
    return mats, list(inputs[len(mats):])


def _infer_moe_experts(ins: list[TensorType], a: Attrs) -> TensorType:
    x, weights, ids, *rest = ins
    mats, biases = split_expert_inputs(rest, rest)
    _check(a.get("activation", "swiglu") in EXPERT_ACTIVATIONS,
           f"moe_experts activation {a.get('activation')!r}; known: {', '.join(EXPERT_ACTIVATIONS)}")
    _check(a.get("activation", "swiglu") == "swiglu" or len(mats) == 2,
           "moe_experts activation='clamped_swiglu' reads a fused, interleaved w_gate_up [E, 2F, H]")
    _check(x.rank == 2 and isinstance(x.shape[1], int), f"moe_experts input must be [T, hidden], got {x}")
    _check(ids.dtype == MOE_IDS_DTYPE,
           f"moe_experts ids must be {MOE_IDS_DTYPE} (the router contract), got {ids}")
    _check(weights.dtype == MOE_WEIGHTS_DTYPE,
           f"moe_experts routing weights must be {MOE_WEIGHTS_DTYPE} (the router contract), got {weights}")
    _check(ids.rank == 2 and weights.shape == ids.shape and _same(ids.shape[0], x.shape[0]),
           f"moe_experts routing weights {weights} and ids {ids} must both be [T, top_k] over input {x}")
    hidden = x.shape[1]
    down = mats[-1]
    _check(len(mats) in (2, 3) and all(m.rank == 3 for m in rest[:len(mats)]),
           f"expert weights must be 3-D [experts, out, in] (then 2-D biases), got {', '.join(map(str, rest))}")
    experts = down.shape[0]
    _check(all(m.shape[0] == experts for m in mats), f"expert weights disagree on the expert count: "
                                                       f"{', '.join(map(str, mats))}")
    ffn = down.shape[2]
    _check(down.shape[1] == hidden, f"expert down projection {down} must be [experts, {hidden}, ffn]")
    if len(mats) == 2:
        _check(mats[0].shape == (experts, 2 * ffn, hidden),
               f"fused expert gate_up {mats[0]} must be [{experts}, {2 * ffn}, {hidden}] for down {down}")
        if biases:
            _check(len(biases) == 2 and biases[0].shape == (experts, 2 * ffn) and biases[1].shape == (experts, hidden),
                   f"expert biases {', '.join(map(str, biases))} must be b_gate_up [{experts}, {2 * ffn}] and "
                   f"b_down [{experts}, {hidden}]")
    else:
        _check(not biases, "expert biases go with a fused w_gate_up")
        for m in mats[:2]:
            _check(m.shape == (experts, ffn, hidden),
                   f"expert gate/up {m} must be [{experts}, {ffn}, {hidden}] for down {down}")
    return x


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on an interleaved gate/up row (gate at even, up at odd columns): gate clamped
    above at `limit`, up to ±limit, (up + 1) · gate · sigmoid(alpha · gate)."""
    gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _ref_moe_experts(ctx: RefContext | None, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     *rest: torch.Tensor, activation: str = "swiglu", alpha: float = 1.702,
                     limit: float = 7.0) -> torch.Tensor:
    """Σ_k weights[t, k] · down_e(act(gate_up_e(x_t))), e = ids[t, k]; experts in ascending order."""
    mats = [m for m in rest if m.dim() == 3]
    b_gate_up, b_down = rest[len(mats):] or (None, None)
    if len(mats) == 3:
        mats = (torch.cat([mats[0], mats[1]], dim=1), mats[2])
    gate_up, down = mats
    ids = ids.long()
    out = torch.zeros_like(x)
    for e in range(down.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.linear(x[token], gate_up[e], None if b_gate_up is None else b_gate_up[e])
        f = h.shape[-1] // 2
        act = clamped_swiglu(h, alpha, limit) if activation == "clamped_swiglu" else F.silu(h[:, :f]) * h[:, f:]
        y = F.linear(act, down[e], None if b_down is None else b_down[e])
        out.index_add_(0, token, (y.float() * weights[token, slot, None].float()).to(x.dtype))
    return out


def _moe_experts_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    x, weights, ids, *rest = ins
    mats, _ = split_expert_inputs(rest, rest)
    tokens, top_k, experts = x.shape[0], ids.shape[1], mats[-1].shape[0]
    tokens = tokens if isinstance(tokens, int) else 1
    per_expert = sum(m.numel() // experts for m in mats)
    touched = min(experts, tokens * top_k)  # distinct experts a step can read at most
    wbytes = touched * per_expert * DTYPE_BYTES.get(mats[-1].dtype, 4)
    return Cost(flops=2 * tokens * top_k * per_expert,
                bytes=wbytes + _nbytes(x) + _nbytes(weights) + _nbytes(ids) + _nbytes(out))


MOE_EXPERT_ATTRS = {"activation": "swiglu", "alpha": 1.702, "limit": 7.0}

register_op(OpDef(
    "moe_experts", 5, 7, infer=_infer_moe_experts, reference=_ref_moe_experts, cost=_moe_experts_cost,
    attrs=dict(MOE_EXPERT_ATTRS),
    doc="Routed SwiGLU experts: moe_experts(x, weights, ids, w_gate_up [E, 2F, H], w_down [E, H, F]) or with "
        "separate w_gate, w_up [E, F, H] (what checkpoints store; fuse_expert_gate_up merges them). "
        "Σ_k weights[:, k] · down_e(silu(gate_e(x)) · up_e(x)) for e = ids[:, k]. A fused w_gate_up may be "
        "followed by biases b_gate_up [E, 2F], b_down [E, H] (gpt-oss). activation='clamped_swiglu' (gpt-oss): "
        "gate/up rows interleaved (gate even, up odd), (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g) with "
        "g = min(gate, limit)."))


register_op(OpDef(
    "moe_experts_a2a", 5, 7, infer=_infer_moe_experts, reference=_ref_moe_experts, cost=_moe_experts_cost,
    attrs=dict(MOE_EXPERT_ATTRS),
    doc="moe_experts under data-parallel attention with every expert group one rank: each rank's own rows go, "
        "pair by (token, expert) pair, to the rank holding the expert and come back computed (all_to_all), "
        "instead of every rank gathering all rows and reduce-scattering partial sums. Same meaning."))


# ---------------------------------------------------------------- collectives (parallel programs)
#
# The IR keeps global shapes: a collective's meaning on the global values is the identity (an all-reduce of a
# partial value *is* the value; gathering a sharded one *is* it), so the reference interpreter runs a placed
# program as it runs the unplaced one. What each rank holds, and so what the kernels exchange, is the
# placement's business (compiler/placement.py).


def _identity(ctx: RefContext | None, x: torch.Tensor, **attrs: Any) -> torch.Tensor:
    return x


def _collective_cost(ins: list[TensorType], out: ValueType, a: Attrs) -> Cost:
    return Cost(0, _nbytes(ins[0]) + _nbytes(out))


register_op(OpDef("all_reduce", 1, 1, infer=_infer_unary, reference=_identity, cost=_collective_cost,
                  doc="Sum of every rank's partial value (a row-parallel GEMM's, a masked embedding lookup's, a "
                      "sharded MoE's), replicated on every rank."))


def _infer_all_gather(ins: list[TensorType], a: Attrs) -> TensorType:
    _check(isinstance(a.get("dim"), int) and 0 <= a["dim"] < ins[0].rank, f"all_gather dim {a.get('dim')} out of "
           f"range for {ins[0]}")
    return ins[0]


register_op(OpDef("all_gather", 1, 1, infer=_infer_all_gather, reference=_identity, cost=_collective_cost,
                  attrs={"dim": REQUIRED},
                  doc="Every rank's part of a value sharded on `dim`, concatenated (padding dropped): the "
                      "vocab-parallel LM head's logits."))


register_op(OpDef("gather_logits", 1, 1, infer=_infer_all_gather, reference=_identity, cost=_collective_cost,
                  attrs={"dim": 1},
                  doc="The vocab-parallel LM head's logits on every rank: all of them (an all_gather, padding "
                      "dropped), or, in a step whose rows need no more (`batch.logit_candidates` = k > 0: greedy, "
                      "top-k sampling), each row's k largest, found from every rank's top k (value, index) pairs, the "
                      "other columns -inf (passes/vocab_parallel_sampling.py)."))


def _infer_dp_gather(ins: list[TensorType], a: Attrs) -> TensorType:
    _check(a.get("rows", "tokens") in ("tokens", "logits"), f"dp_gather rows={a.get('rows')!r}: tokens or logits")
    return ins[0]


register_op(OpDef("dp_gather", 1, 1, infer=_infer_dp_gather, reference=_identity, cost=_collective_cost,
                  attrs={"rows": "tokens"},
                  doc="Data-parallel attention: every rank's rows (its sequences' tokens, or their logits rows), "
                      "concatenated in rank order on every rank (an all-gather of ragged row counts)."))
register_op(OpDef("dp_scatter", 1, 1, infer=_infer_unary, reference=_identity, cost=_collective_cost,
                  doc="Data-parallel attention: the sum of every rank's partial value over all ranks' rows, each "
                      "rank keeping its own rows (a reduce-scatter of ragged row counts)."))
register_op(OpDef("all_reduce_add_rms_norm", 3, 3, infer=_infer_add_rms_norm, reference=_ref_add_rms_norm,
                  cost=_elementwise_cost(5), attrs={"eps": 1e-6},
                  doc="(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual): the reduction of a "
                      "row-parallel GEMM fused with the residual add and the norm that follow it."))
