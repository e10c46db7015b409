"""Quantizes the weight of every `linear` over a plain param: fp8 e4m3 (tensor/channel/block) or int4 AWQ/GPTQ."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kiln.compiler import Attrs, ParamSpec, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites

FLOAT_DTYPES = ("f32", "bf16", "f16")
# fp8(act=...) -> linear_fp8's `act` attribute
FP8_ACT_OPTIONS = {"none": "none", "dynamic": "dynamic_per_token", "static": "static_per_tensor"}
T = TypeVar("T")


@dataclass(frozen=True)
class WeightScheme:
    """A parsed `quantize { weights = ... }`.

    fp8:  `fp8` (per-tensor scale), `fp8(per_channel=true)` (one scale per output row), `fp8(block=128)`
          (one per 128x128 tile, DeepSeek-V3); `act=dynamic` also quantizes activations per token (w8a8);
          `act=static` quantizes them with one calibrated scale per linear input (compressed-tensors
          `input_scale`; computed at compile time for a float checkpoint).
    awq:  `awq(group=128)` — AutoAWQ GEMM checkpoints, loaded as published.
    gptq: `gptq(group=128, sym=true, format=v1)` — AutoGPTQ/GPTQModel checkpoints; format v1 (zeros stored
          minus one: what both libraries write) or v2 (GPTQModel's internal gptq_v2).
    """

    kind: str
    granularity: str = "tensor"
    block: int = 0
    act: str = "none"
    group: int = 128
    zero_offset: int = 1
    sym: bool = True

    def to_attrs(self) -> dict[str, Any]:
        if self.kind == "fp8":
            return {"granularity": self.granularity, "block": self.block, "act": self.act}
        return {"format": self.kind, "group": self.group, "zero_offset": self.zero_offset}


def _options(value: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        return value, {}
    if isinstance(value, Mapping) and "kind" in value:
        if value.get("args"):
            raise ValueError(f"{value['kind']}(...) takes keyword options only, e.g. {value['kind']}(group=128)")
        return value["kind"], {k: v for k, v in value.items() if k not in ("kind", "args")}
    raise ValueError(f"not a quantization scheme: {value!r}")


def _check_keys(kind: str, opts: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"{kind}(...) has no option '{unknown[0]}' (options: {', '.join(allowed)})")


def _fp8(opts: Mapping[str, Any]) -> WeightScheme:
    _check_keys("fp8", opts, ("per_channel", "block", "act"))
    block, per_channel = opts.get("block"), opts.get("per_channel", False)
    if not isinstance(per_channel, bool):
        raise ValueError("fp8(per_channel=...) must be true or false")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block <= 0):
        raise ValueError(f"fp8(block=...) must be a positive int, got {block!r}")
    if block is not None and per_channel:
        raise ValueError("fp8 takes per_channel=true or block=N, not both")
    act = opts.get("act", "none")
    if act not in FP8_ACT_OPTIONS:
        raise ValueError(f"fp8(act=...) is none (weight-only), dynamic (per-token fp8 activations) or static "
                         f"(one calibrated per-tensor activation scale), got {act!r}")
    if act == "static" and block is not None:
        raise ValueError("fp8(block=N) takes act=dynamic (1x128 activation tiles), not act=static")
    granularity = "block" if block else "channel" if per_channel else "tensor"
    return WeightScheme("fp8", granularity, block or 0, FP8_ACT_OPTIONS[act])


def _group(kind: str, opts: Mapping[str, Any]) -> int:
    group = opts.get("group", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 8:
        raise ValueError(f"{kind}(group=...) must be a positive multiple of 8, got {group!r}")
    return group


def _awq(opts: Mapping[str, Any]) -> WeightScheme:
    _check_keys("awq", opts, ("group", "zero_point"))
    if opts.get("zero_point", True) is not True:
        raise ValueError("awq(zero_point=false) is not supported: AutoAWQ GEMM checkpoints carry zero points")
    return WeightScheme("awq", group=_group("awq", opts), zero_offset=0)


def _gptq(opts: Mapping[str, Any]) -> WeightScheme:
    _check_keys("gptq", opts, ("group", "sym", "format"))
    fmt = opts.get("format", "v1")
    if fmt not in ("v1", "v2"):
        raise ValueError(f"gptq(format=...) is v1 (zeros stored minus one, as AutoGPTQ/GPTQModel save) or v2, "
                         f"got {fmt!r}")
    sym = opts.get("sym", True)
    if not isinstance(sym, bool):
        raise ValueError("gptq(sym=...) must be true or false")
    return WeightScheme("gptq", group=_group("gptq", opts), zero_offset=1 if fmt == "v1" else 0, sym=sym)


SCHEMES: dict[str, Callable[[Mapping[str, Any]], WeightScheme]] = {"fp8": _fp8, "awq": _awq, "gptq": _gptq}


def parse_weight_scheme(value: Any) -> WeightScheme:
    """The scheme of a recipe's `quantize.weights` value; ValueError says what is wrong with it."""
    kind, opts = _options(value)
    if kind not in SCHEMES:
        raise ValueError(f"unknown weight quantization '{kind}' (known: {', '.join(SCHEMES)})")
    return SCHEMES[kind](opts)


def quantize_option(program: Program, ctx: PassContext, key: str, parse: Callable[[Any], T]) -> T | None:
    """`quantize.{key}` of the recipe (ctx.options, else program.meta) parsed by `parse`; None when absent.
    A ValueError from `parse` becomes a PassError naming the setting."""
    value = (ctx.options.get("quantize") or program.meta.get("quantize") or {}).get(key)
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError as e:
        raise PassError(f"quantize.{key}: {e}") from None


# ---------------------------------------------------------------- the rewrite


def _stem(spec: ParamSpec, scheme: WeightScheme) -> str:
    """The checkpoint prefix of a weight ("model.layers.{i}.mlp.up_proj" for ".../up_proj.weight")."""
    src = spec.source[0]
    if not src.endswith(".weight"):
        raise PassError(f"param '{spec.name}': cannot derive the {scheme.kind} tensors of checkpoint source '{src}' "
                        "(expected a name ending in '.weight')")
    return src[: -len(".weight")]


def _fp8_weight(m: Match, b: Builder, scheme: WeightScheme, spec: ParamSpec) -> tuple[str, ...]:
    n, k = spec.shape
    block = scheme.block
    scale_shape = {"tensor": (1,), "channel": (n,), "block": (-(-n // max(block, 1)), -(-k // max(block, 1)))}
    quant = {"scheme": "fp8", "granularity": scheme.granularity, "block": block, "of": spec.name,
             "weight_shape": spec.shape, "dtype": spec.dtype}
    w = ParamSpec(f"{spec.name}_fp8", spec.shape, "fp8e4m3", spec.source, spec.block, quant=Attrs(
        {**quant, "role": "weight"}), loc=spec.loc)
    s = ParamSpec(f"{spec.name}_scale", scale_shape[scheme.granularity], "f32", spec.source, spec.block,
                  quant=Attrs({**quant, "role": "weight_scale"}), loc=spec.loc)
    params = (b.add_param(w, after=spec.name), b.add_param(s, after=spec.name))
    if scheme.act != "static_per_tensor":
        return params
    # the checkpoint's `<stem>.input_scale` (derived from the weight's source by the converter), else calibrated
    xs = ParamSpec(f"{spec.name}_input_scale", (1,), "f32", spec.source, spec.block,
                   quant=Attrs({**quant, "role": "input_scale"}), loc=spec.loc)
    return (*params, b.add_param(xs, after=spec.name))


def _int4_weight(m: Match, b: Builder, scheme: WeightScheme, spec: ParamSpec) -> tuple[str, ...]:
    n, k = spec.shape
    g = scheme.group
    if k % g or n % 8 or (scheme.kind == "gptq" and k % 8):
        raise PassError(f"param '{spec.name}' [{n}, {k}]: {scheme.kind} needs in_features divisible by group={g} "
                        "and out_features by 8")
    stem = _stem(spec, scheme)
    quant = {"scheme": scheme.kind, "group": g, "of": spec.name, "weight_shape": spec.shape, "dtype": spec.dtype}
    packed = (k, n // 8) if scheme.kind == "awq" else (k // 8, n)
    parts = [("qweight", packed, "i32"), ("qzeros", (k // g, n // 8), "i32"), ("scales", (k // g, n), "f16")]
    if scheme.kind == "gptq":
        parts.append(("g_idx", (k,), "i32"))
    return tuple(b.add_param(ParamSpec(f"{spec.name}_{role}", shape, dtype, (f"{stem}.{role}",), spec.block,
                                       quant=Attrs({**quant, "role": role}), loc=spec.loc), after=spec.name)
                 for role, shape, dtype in parts)


def _quantize(scheme: WeightScheme) -> Callable[[Match, Builder], str | None]:
    def replace(m: Match, b: Builder) -> str | None:
        spec = m.param("w")
        x_dtype = m.graph.node(m["x"]).out.dtype
        bias = (m["b"],) if "b" in m.bindings else ()
        if scheme.kind == "fp8":
            w, s, *xs = _fp8_weight(m, b, scheme, spec)
            if scheme.act != "none":  # w8a8: no weight-only form to fuse later
                return b.add("linear_fp8", (m["x"], w, s, *xs, *bias), hint=m.root, **scheme.to_attrs())
            dq = b.add("dequant_fp8", (w, s), hint=f"{spec.local_name}_dq", granularity=scheme.granularity,
                       block=scheme.block, dtype=x_dtype)
        else:
            if not spec.source:
                raise PassError(f"param '{spec.name}': {scheme.kind} loads pre-quantized checkpoints; "
                                "weights = random(...) has none")
            dq = b.add("dequant_int4", _int4_weight(m, b, scheme, spec), hint=f"{spec.local_name}_dq",
                       dtype=x_dtype, **scheme.to_attrs())
        return b.add("linear", (m["x"], dq, *bias), hint=m.root)

    return replace


def _plain_weight(m: Match) -> bool:
    spec = m.param("w")
    return (spec.quant is None and spec.sharding is None and len(spec.shape) == 2 and spec.dtype in FLOAT_DTYPES
            and len(spec.source) <= 1)


def weight_rewrites(scheme: WeightScheme) -> tuple[Rewrite, ...]:
    replace = _quantize(scheme)
    return (
        # linear(x, w) -> linear(x, dequant(w_q, scales...))     (w8a8 fp8: linear_fp8(x, w_q, w_scale[, x_scale]))
        Rewrite("weight", P("linear", V("x"), P("param", name="w")), replace=replace, extra_check=_plain_weight),
        # linear(x, w, b) -> linear(x, dequant(w_q, scales...), b)
        Rewrite("weight_bias", P("linear", V("x"), P("param", name="w"), V("b")), replace=replace,
                extra_check=_plain_weight),
    )


@register_pass("quantize_weights", requires=("shape_inference",),
               before=("fuse_qkv", "fuse_gate_up", "fuse_dequant_linear", "kernel_selection"))
class QuantizeWeights(Pass):
    """Requires: typed IR; the scheme from the recipe's `quantize { weights = ... }` (ctx.options, else
    program.meta; absent: nothing changes). Guarantees: every `linear` whose weight is a plain 2-D float param
    (one checkpoint source or none) reads it through a dequant op over quantized params instead —
    `dequant_fp8(w_fp8, w_scale)` (fp8; with act=dynamic directly `linear_fp8`; with act=static
    `linear_fp8(x, w_fp8, w_scale, w_input_scale)`), or `dequant_int4(qweight,
    qzeros, scales[, g_idx])` (awq/gptq, sources `<stem>.qweight` ... for a `<stem>.weight` source). The new
    params carry `quant` attrs the weight converter reads (role, scheme, granularity/group, the original
    param); fp8 ones keep the float weight's source and are quantized at compile time unless the checkpoint
    already holds fp8 + scales. Embeddings and the LM head (`embedding`/`logits`) stay unquantized."""

    def __init__(self, scheme: WeightScheme | None = None):
        self.scheme = scheme

    def run(self, program: Program, ctx: PassContext) -> Program:
        scheme = self.scheme if self.scheme is not None else quantize_option(program, ctx, "weights",
                                                                             parse_weight_scheme)
        if scheme is None:
            return program
        ctx.stats["scheme"] = scheme.kind + ("" if scheme.kind != "fp8" else f"/{scheme.granularity}")
        return apply_rewrites(program, weight_rewrites(scheme), ctx)
