"""Quantizes the weight of every `linear` over a plain param: fp8 e4m3 (tensor/channel/block) or int4 AWQ/GPTQ."""
from __future__ import annotations

from collections.abc import Callable

from kiln.compiler import Attrs, ParamSpec, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.options import QuantizeOptions, RecipeOptions, WeightScheme
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites
from kiln.dsl.errors import KilnError

FLOAT_DTYPES = ("f32", "bf16", "f16")


def recipe_quantize(program: Program, ctx: PassContext) -> QuantizeOptions:
    """The recipe's `quantize` options (ctx.options, else program.meta; compiler/options.py parses them). A
    value that does not parse (a hand-made meta) is a PassError naming the setting."""
    try:
        return RecipeOptions.from_meta(ctx.options or program.meta).quantize
    except KilnError as e:
        raise PassError(str(e)) from None


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
        scheme = self.scheme if self.scheme is not None else recipe_quantize(program, ctx).weights
        if scheme is None:
            return program
        ctx.stats["scheme"] = scheme.kind + ("" if scheme.kind != "fp8" else f"/{scheme.granularity}")
        return apply_rewrites(program, weight_rewrites(scheme), ctx)
