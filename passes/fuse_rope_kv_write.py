"""Folds the rope of q and k into the attention that caches k: one kernel ropes q/k and writes the paged KV."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites


def _fusable(m: Match) -> bool:
    """q and k rotated the same way (the two halves of one `q, k = rope(q, k, ...)`), into an attention that
    has no rope yet and a plain KV cache: calibrating fp8 KV scales observes the attention's k, which must be
    roped (quantize_kv_cache runs first, so an fp8 attention is left as it is)."""
    node = m.node("attention")
    return (m.node("rq").attrs == m.node("rk").attrs and node.attrs.get("rope") is None
            and not node.attrs.get("kv_dtype"))


def _rope_attention(m: Match, b: Builder) -> str:
    # Every attribute of the rope node travels, whatever rope grows (scalings, yarn's magnitude): codegen builds
    # the fused attention's cos/sin table from them exactly as it would for the rope node.
    attrs = {**dict(m.node("attention").attrs), "rope": dict(m.node("rq").attrs)}
    sinks = (m["sinks"],) if "sinks" in m.bindings else ()  # gpt-oss's per-head sink logits stay last
    return b.add("attention", (m["q"], m["k"], m["v"], *sinks), hint=m.root, **attrs)


REWRITES = (
    # attention(rope(q), rope(k), v) -> attention(q, k, v) {rope={the rope's attributes}}
    Rewrite("rope_kv_write",
            P("attention", P("rope", V("q"), name="rq"), P("rope", V("k"), name="rk"), V("v"), name="attention"),
            replace=_rope_attention, extra_check=_fusable),
    # attention(rope(q), rope(k), v, sinks) -> attention(q, k, v, sinks) {rope=...} (gpt-oss)
    Rewrite("rope_kv_write_sinks",
            P("attention", P("rope", V("q"), name="rq"), P("rope", V("k"), name="rk"), V("v"), V("sinks"),
              name="attention"),
            replace=_rope_attention, extra_check=_fusable),
)


# after quantize_kv_cache: fp8 KV calibration observes the attention's roped k
@register_pass("fuse_rope_kv_write", requires=("shape_inference",), after=("quantize_kv_cache",),
               before=("kernel_selection",))
class FuseRopeKVWrite(Pass):
    """Requires: typed IR; run after quantize_kv_cache. Guarantees: every three-input `attention` whose q and k
    are `rope`s with equal attributes reads the un-roped q and k and carries `rope` = that rope's attribute dict
    (all of it); its kernel rotates q and k and writes roped K and V into the paged cache in one launch. A rope
    read by anything else stays for that reader. Attentions over an fp8 KV cache, and MLA (whose roped parts
    are separate q_pe / k_pe inputs of `mla_attention`), are left alone."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
