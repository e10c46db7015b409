"""Stores each attention's KV cache in fp8 e4m3 with per-KV-head scales, and each MLA latent cache with one
per-layer scale (`quantize { kv_cache = fp8 }`)."""
from __future__ import annotations

from kiln.compiler import Attrs, ParamSpec, Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites
from kiln.passes.quantize_weights import recipe_quantize

KV_DTYPE = "fp8e4m3"
# Between a K/V projection and the attention: head split, qk-norm, rotary embedding, the fused-qkv slice.
_TO_PROJECTION = ("view", "rms_norm", "rope", "slice", "deinterleave")


def _checkpoint_prefix(m: Match, value: str) -> str | None:
    """The attention module's checkpoint prefix ("model.layers.{i}.self_attn"), read off the source of the
    projection weight that produces `value` (through views, norms, rope, slices and dequant ops)."""
    g = m.graph
    vid = value
    while g.node(vid).op in _TO_PROJECTION:
        vid = g.node(vid).inputs[0]
    node = g.node(vid)
    if node.op not in ("linear", "linear_fp8", "linear_w4a16") or len(node.inputs) < 2:
        return None
    w = g.node(node.inputs[1])
    if w.op in ("dequant_fp8", "dequant_int4"):
        w = g.node(w.inputs[0])
    if w.op != "param":
        return None
    spec = m.params[w.attrs["name"]]
    if not spec.source or spec.source[0].count(".") < 2:
        return None
    return spec.source[0].rsplit(".", 2)[0]


def _scales(m: Match, b: Builder, scales: str) -> tuple[str, str]:
    k_type = m.graph.node(m["k"]).out
    kv_heads = k_type.shape[1]
    block = next((s.name for s in m.program.blocks.values() if s.graph == m.graph.name), None)
    prefix = _checkpoint_prefix(m, m["k"])
    out = []
    for kv in ("k", "v"):
        source = (f"{prefix}.{kv}_scale",) if prefix else ()
        alt = (f"{prefix}.{kv}_proj.output_scale",) if prefix else ()  # older llm-compressor exports
        name = f"{block}.{kv}_scale" if block else f"{kv}_scale"
        spec = ParamSpec(name, (kv_heads,), "f32", source, block, quant=Attrs(
            {"scheme": "fp8", "role": "kv_scale", "kv": kv, "scales": scales, "alt_sources": alt}))
        out.append(b.add_param(spec))
    return out[0], out[1]


def _latent_scale(m: Match, b: Builder, scales: str) -> str:
    """The MLA latent cache's one per-layer scale: a [1] param, source `<attn prefix>.k_scale` (the name
    compressed-tensors gives an attention's cache scale; DeepSeek's own fp8 checkpoints publish none, so
    "auto" calibrates absmax / 448 over the layer's [c_kv | k_pe])."""
    block = next((s.name for s in m.program.blocks.values() if s.graph == m.graph.name), None)
    prefix = _checkpoint_prefix(m, m["c_kv"])
    name = f"{block}.kv_scale" if block else "kv_scale"
    spec = ParamSpec(name, (1,), "f32", (f"{prefix}.k_scale",) if prefix else (), block, quant=Attrs(
        {"scheme": "fp8", "role": "kv_scale", "kv": "latent", "scales": scales, "alt_sources": ()}))
    return b.add_param(spec)


def kv_rewrites(scales: str) -> tuple[Rewrite, ...]:
    def replace_mla(m: Match, b: Builder) -> str:
        node = m.node("attention")
        return b.add("mla_attention", (*node.inputs, _latent_scale(m, b, scales)), hint=m.root,
                     **{**dict(node.attrs), "kv_dtype": KV_DTYPE})

    def replace(m: Match, b: Builder) -> str:
        node = m.node("attention")
        k_scale, v_scale = _scales(m, b, scales)
        sinks = (m["sinks"],) if "sinks" in m.bindings else ()  # gpt-oss's per-head sink logits stay last
        return b.add("attention", (m["q"], m["k"], m["v"], k_scale, v_scale, *sinks), hint=m.root,
                     **{**dict(node.attrs), "kv_dtype": KV_DTYPE})

    return (
        # attention(q, k, v) -> attention(q, k, v, k_scale, v_scale) {kv_dtype="fp8e4m3"}
        Rewrite("kv_fp8", P("attention", V("q"), V("k"), V("v"), name="attention"), replace=replace,
                extra_check=lambda m: not m.node("attention").attrs.get("kv_dtype")),
        # attention(q, k, v, sinks) -> attention(q, k, v, k_scale, v_scale, sinks) {kv_dtype="fp8e4m3"} (gpt-oss)
        Rewrite("kv_fp8_sinks", P("attention", V("q"), V("k"), V("v"), V("sinks"), name="attention"),
                replace=replace, extra_check=lambda m: not m.node("attention").attrs.get("kv_dtype")),
        # mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b) -> mla_attention(..., kv_scale) {kv_dtype="fp8e4m3"}
        Rewrite("kv_fp8_mla", P("mla_attention", V("q_nope"), V("q_pe"), V("c_kv"), V("k_pe"), V("w_kv_b"),
                                name="attention"),
                replace=replace_mla, extra_check=lambda m: not m.node("attention").attrs.get("kv_dtype")),
    )


# after fuse_qkv, which matches the plain three-input attention
@register_pass("quantize_kv_cache", requires=("shape_inference",), after=("fuse_qkv",), before=("kernel_selection",))
class QuantizeKVCache(Pass):
    """Requires: typed IR; `quantize { kv_cache = fp8 }` in ctx.options (else program.meta; absent: nothing
    changes). Run after fuse_qkv (which matches the plain three-input attention). Guarantees: every
    `attention` has kv_dtype="fp8e4m3" and reads two new f32 [kv_heads] params, `{block}.k_scale` and
    `{block}.v_scale` (source `<attn prefix>.k_scale`, as compressed-tensors writes it; quant attrs tell the
    weight converter whether it may instead calibrate them: absmax / 448 per layer and KV head over a
    calibration run of the reference interpreter). Every `mla_attention` gets kv_dtype="fp8e4m3" and a sixth
    input, an f32 [1] `{block}.kv_scale`: one scale for the whole latent row [c_kv | k_pe] (one cached
    "head"), same sources and calibration (absmax / 448 over the layer's latent entries)."""

    def __init__(self, scales: str | None = None):
        self.scales = scales

    def run(self, program: Program, ctx: PassContext) -> Program:
        scales = self.scales if self.scales is not None else recipe_quantize(program, ctx).kv_cache
        if scales is None:
            return program
        return apply_rewrites(program, kv_rewrites(scales), ctx)
