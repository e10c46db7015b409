"""Absorbs MLA's up-projections for decode: W_UK into the query, W_UV into the output (DeepSeek-V2 §2.1.2)."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites


def _absorbable(m: Match) -> bool:
    # Already absorbed, or a quantized/sharded w_kv_b the kernel cannot view as per-head [W_UK; W_UV] blocks.
    spec = m.param("w_kv_b")
    return m.node("attention").attrs.get("absorb", "none") == "none" and spec.quant is None and spec.sharding is None


def _absorb(m: Match, b: Builder) -> str:
    node = m.node("attention")
    return b.add("mla_attention", node.inputs, hint=m.root, **{**dict(node.attrs), "absorb": "decode"})


REWRITES = (
    # mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b) -> mla_attention(...) {absorb="decode"}
    Rewrite("mla_absorb_decode",
            P("mla_attention", V("q_nope"), V("q_pe"), V("c_kv"), V("k_pe"), P("param", name="w_kv_b"),
              name="attention"),
            replace=_absorb, extra_check=_absorbable),
)


@register_pass("mla_absorption", requires=("shape_inference",), before=("kernel_selection",))
class MLAAbsorption(Pass):
    """Requires: typed IR. Guarantees: every `mla_attention` whose `w_kv_b` is a plain (unquantized,
    unsharded) param has `absorb="decode"`: its kernel runs decode tokens in latent space — q_lat = q_nope·W_UK
    ([H, kv_lora_rank]), attention over the cached [c_kv | k_pe] as one head of width kv_lora_rank + rope dim,
    output o_lat·W_UVᵀ — and keeps prefill tokens un-absorbed (per-head K/V expanded from the latent, cheaper
    when many queries share them). W_UK and W_UV are the per-head row blocks of w_kv_b, so no weight is added or
    duplicated, and the op's meaning (its reference) is unchanged."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
