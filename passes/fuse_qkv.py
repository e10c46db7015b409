"""Merges the q, k and v projections of an attention into one linear over a fused `wqkv` param."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import P, Pat, Rewrite, V, apply_rewrites
from kiln.passes.linear_fusion import (
    QUANT_WEIGHT_OPS,
    fuse_linears,
    fuse_quantized_linears,
    fusible_linears,
    fusible_quantized,
    quantized_projection,
)

ROLES = ("q", "k", "v")
# Between a projection and its attention operand: the head split, qk-norm (Qwen3, Gemma) and rotary embedding.
PROJECTION_TO_HEADS = ("view", "rms_norm", "rope")


def _projection(role: str, bias: bool) -> Pat:
    ins = (V("x"), P("param", name=f"w{role}")) + ((P("param", name=f"b{role}"),) if bias else ())
    return P("linear", *ins, name=role, through=PROJECTION_TO_HEADS)


def _attention(bias: bool, sinks: bool = False) -> Pat:
    return P("attention", *(_projection(r, bias) for r in ROLES), *_SINKS[sinks], name="attention")


# an attention's optional last input, its per-head sink logits (gpt-oss): kept as it is
_SINKS = {False: (), True: (V("sinks"),)}


def _quantized(op: str, bias: bool, sinks: bool) -> Rewrite:
    return Rewrite(f"qkv_{op}" + ("_bias" if bias else "") + ("_sinks" if sinks else ""),
                   P("attention", *(quantized_projection(op, r, bias, PROJECTION_TO_HEADS) for r in ROLES),
                     *_SINKS[sinks], name="attention"),
                   replace=lambda m, b: fuse_quantized_linears(m, b, op, ROLES, bias, fused="qkv"),
                   extra_check=lambda m: fusible_quantized(m, op, ROLES, bias))


def _plain(bias: bool, sinks: bool) -> Rewrite:
    return Rewrite("qkv" + ("_bias" if bias else "") + ("_sinks" if sinks else ""), _attention(bias, sinks),
                   replace=lambda m, b: fuse_linears(m, b, ROLES, bias=bias, fused="qkv"),
                   extra_check=lambda m: fusible_linears(m, ROLES, bias=bias))


REWRITES = (
    # attention(..linear(x, wq).., ..linear(x, wk).., ..linear(x, wv)..)
    #   -> y = linear(x, wqkv); attention(..slice(y, 0, nq).., ..slice(y, nq, nq+nk).., ..slice(y, nq+nk, n)..);
    # with biases bq, bk, bv -> bqkv (Qwen2); with the attention's per-head sinks last (gpt-oss), kept as they are
    *(_plain(bias, sinks) for sinks in (False, True) for bias in (False, True)),
    # the same over quantized weights (linear_fusion's docstring: which schemes concatenate exactly):
    # attention(..linear(x, dequant(wq_*)).., ..k.., ..v..) -> y = linear(x, dequant(wqkv_*)); slices of y
    # attention(..linear_fp8(x, wq_fp8, wq_scale).., ..k.., ..v..) -> y = linear_fp8(x, wqkv_fp8, wqkv_scale); ...
    *(_quantized(op, bias, sinks) for op in QUANT_WEIGHT_OPS for bias in (False, True) for sinks in (False, True)),
)


@register_pass("fuse_qkv", requires=("shape_inference",), before=("kernel_selection",))
class FuseQKV(Pass):
    """Requires: typed IR. Guarantees: each attention whose q, k and v are projections of one input by
    plain `param` weights (all with bias or none) reads them from a single linear over `{block}.wqkv`
    (`source` = q's sources, then k's, then v's, concatenated along dim 0; bias `{block}.bqkv` likewise),
    sliced back into q, k, v in that order. The replaced params are dropped once no graph reads them.
    Quantized q/k/v (fp8; int4 AWQ, not GPTQ) merge the same way into `{block}.wqkv_<role>` params where
    the concatenation is exact (see linear_fusion): per-tensor fp8 scales become per-channel."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
