"""Materialising quantized params (those with `ParamSpec.quant`, declared by the quantize_* passes).

* fp8 weights (`role` weight / weight_scale, sources = the float weight's): a checkpoint that already holds
  e4m3 weights is loaded as is, with its scales — compressed-tensors `<stem>.weight_scale` ([1] / [N, 1])
  or DeepSeek `<stem>.weight_scale_inv` ([ceil(N/128), ceil(K/128)]). A float checkpoint (or random weights) is
  quantized here, at compile time. Either way the granularity must be the recipe's.
* static activation scales (`role` input_scale, fp8(act=static)): a pre-quantized (e4m3) checkpoint must hold
  compressed-tensors' `<stem>.input_scale` (one f32, the scale it was calibrated with; missing: an error naming
  it); for a float checkpoint or random weights there is none to read, so it is calibrated like the KV scales:
  absmax of the linear's input / 448 over the calibration tokens, from a run with weight-only fp8 linears. A
  merged projection (fuse_qkv / fuse_gate_up) takes the largest of its parts' checkpoint scales (one x, one
  scale: see passes/linear_fusion.py); calibration observes the merged linear's input directly.
* int4 (`role` qweight / qzeros / scales / g_idx): AutoAWQ / AutoGPTQ tensors exactly as published (a missing
  GPTQ `g_idx` is the identity grouping k // group). Never re-quantized; random weights are refused.
* merged projections (fuse_qkv / fuse_gate_up over quantized weights; `quant["parts"]` = ((original param,
  rows), ...), one source per part): each part is built as it would be unmerged — loaded, or quantized at
  compile time with its own scale — and the parts concatenate (fp8 along N, per-tensor scales repeated over
  their part's rows; AWQ tensors along their output-column dim 1).
* KV scales (`role` kv_scale): the checkpoint's `<attn>.k_scale` / `v_scale` (per tensor, broadcast to every
  KV head, or per head), else — unless the recipe says scales=checkpoint — calibrated: the reference interpreter
  runs calibration tokens through the model and each layer's scale is absmax(K or V) / 448 per KV head.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from kiln.compiler.interpret import interpret
from kiln.compiler.ir import ParamSpec, Program
from kiln.compiler.quant import FP8_DTYPE, FP8_MAX, fp8_quantize

from .errors import WeightError
from .errors import fmt_shape as _fmt

CALIBRATION_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders stopped to rest their "
    "horses and exchange grain, salt and cloth. Over the centuries the market grew into a town, and the town "
    "into a city of bridges, workshops and schools. Today visitors walk along the old walls, read the carved "
    "names of the guilds above the doors, and eat bread baked in ovens that are older than the cathedral. "
    "In the evening the lights come on one by one, and the river carries them slowly towards the sea. "
    "Question: how many bridges cross the river? Answer: there are seven, and the oldest one is made of stone. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n"
)
CALIBRATION_TOKENS = 256


def _input_scale_name(weight_source: str) -> str:
    """compressed-tensors' activation scale of a linear: `<stem>.input_scale` next to `<stem>.weight`."""
    stem = weight_source[: -len(".weight")] if weight_source.endswith(".weight") else weight_source
    return f"{stem}.input_scale"


def fp8_scale_names(weight_source: str) -> list[str]:
    """Where an e4m3 checkpoint tensor's scale is: compressed-tensors `<name>_scale`, DeepSeek `<name>_scale_inv`."""
    return [f"{weight_source}_scale", f"{weight_source}_scale_inv"]


def _granularity_of(shape: tuple[int, ...], n: int) -> str:
    if len(shape) == 0 or (len(shape) == 1 and shape[0] == 1) or shape == (1, 1):
        return "tensor"
    if shape in ((n,), (n, 1)):
        return "channel"
    return "block"


class QuantizedWeights:
    """Builds the tensors of quantized params, one entry at a time (fp8 weight and scale share one
    quantization). `random_weight(name, spec, layer)` makes the float weight of a random-weights artifact."""

    def __init__(self, program: Program, ckpt: Any, random_weight: Callable[[str, ParamSpec, int | None], torch.Tensor]):
        self.program = program
        self.ckpt = ckpt
        self.random_weight = random_weight
        self._fp8: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------ checks before anything is read
    def check(self, entry: Any) -> None:
        spec, q, ckpt = entry.spec, entry.spec.quant, self.ckpt
        if ckpt is None:
            if q["role"] in ("qweight", "qzeros", "scales", "g_idx"):
                raise WeightError(f"param '{q['of']}': {q['scheme']} loads pre-quantized checkpoints; "
                                  "weights = random(...) has none", spec.loc)
            return
        sources = spec.sources_for(entry.layer)
        if q["role"] == "input_scale":
            for src in sources:
                if src in ckpt and self._is_fp8(src) and _input_scale_name(src) not in ckpt:
                    raise WeightError(
                        f"quantize.weights = fp8(act=static), but the fp8 checkpoint {ckpt.path} has no "
                        f"'{_input_scale_name(src)}' (the static activation scale of param '{q['of']}')", spec.loc,
                        ("a pre-quantized fp8 checkpoint is used with the activation scales it was calibrated "
                         "with; use fp8(act=dynamic) for per-token scales, or compile the float checkpoint to "
                         "calibrate static scales",))
            return
        if q["role"] == "kv_scale":
            if q["scales"] == "checkpoint" and self._kv_source(entry) is None:
                raise WeightError(f"kv_cache = fp8(scales=checkpoint), but {ckpt.path} has no "
                                  f"'{sources[0] if sources else spec.name}' (or its k_proj/v_proj.output_scale); "
                                  "use fp8 or fp8(scales=calibrate) to calibrate them at compile time", spec.loc)
            return
        if q["role"] == "g_idx" and sources[0] not in ckpt:
            return  # synthesized: no act-order
        if not sources or sources[0] not in ckpt:
            what = {"awq": "an AutoAWQ (GEMM) checkpoint: <layer>.qweight, .qzeros, .scales",
                    "gptq": "an AutoGPTQ/GPTQModel checkpoint: <layer>.qweight, .qzeros, .scales[, .g_idx]"}
            near = ckpt.close_matches(sources[0]) if sources else []
            notes = ((f"did you mean '{near[0]}'?",) if near else ()) + (
                (f"{q['scheme']} loads {what[q['scheme']]}",) if q["scheme"] in what else ())
            raise WeightError(f"checkpoint tensor '{sources[0] if sources else '?'}' for {q['role']} of param "
                              f"'{q['of']}' is not in {ckpt.path}", spec.loc, notes)
        for src in sources[1:]:
            if src not in ckpt:
                raise WeightError(f"checkpoint tensor '{src}' for {q['role']} of param '{q['of']}' is not in "
                                  f"{ckpt.path}", spec.loc)
        if q["scheme"] == "fp8":
            for src, (of, want) in zip(sources, self._parts(q), strict=True):
                shape = ckpt.shape(src)
                if shape != want:
                    raise WeightError(f"checkpoint tensor '{src}' has shape {_fmt(shape)}, but param '{of}' "
                                      f"expects {_fmt(want)}", spec.loc)
        elif q["role"] != "g_idx":
            shapes = [ckpt.shape(src) for src in sources]
            dim = spec.concat_dim
            joined = (*shapes[0][:dim], sum(sh[dim] for sh in shapes), *shapes[0][dim + 1:]) if shapes[0] else ()
            if any(len(sh) != len(spec.shape) for sh in shapes) or joined != spec.shape:
                got = " + ".join(f"'{src}' {_fmt(sh)}" for src, sh in zip(sources, shapes, strict=True))
                raise WeightError(f"checkpoint tensor {got} has shape {_fmt(joined)}, but the "
                                  f"{q['scheme']} {q['role']} of param '{q['of']}' (group {q['group']}) is "
                                  f"{_fmt(spec.shape)}", spec.loc)

    # ------------------------------------------------------------ materialising
    def load(self, entry: Any) -> torch.Tensor | None:
        """The entry's tensor; None for a KV scale that must be calibrated."""
        q = entry.spec.quant
        if q["scheme"] == "fp8" and q["role"] in ("weight", "weight_scale"):
            return self._fp8_part(entry)
        if q["role"] == "kv_scale":
            return self._kv_scale(entry)
        if q["role"] == "input_scale":
            return self._input_scale(entry)
        return self._int4_part(entry)

    def _is_fp8(self, src: str) -> bool:
        return self.ckpt.dtype_name(src) == "F8_E4M3"

    def _input_scale(self, entry: Any) -> torch.Tensor | None:
        """The checkpoint's static activation scale (the largest of a merged projection's parts); None when the
        weights are not pre-quantized (float checkpoint, random weights): calibrated then."""
        spec = entry.spec
        if self.ckpt is None:
            return None
        sources = spec.sources_for(entry.layer)
        if not all(src in self.ckpt and self._is_fp8(src) for src in sources):
            return None
        scales = []
        for src in sources:
            name = _input_scale_name(src)
            t = self.ckpt.get(name).float().reshape(-1)
            if t.numel() != 1 or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise WeightError(f"checkpoint '{name}' ({_fmt(t.shape)}) is not one positive activation scale "
                                  "(fp8(act=static) reads compressed-tensors' per-tensor input_scale)", spec.loc)
            scales.append(t)
        return torch.stack(scales).amax(dim=0).contiguous()

    def _fp8_part(self, entry: Any) -> torch.Tensor:
        q = entry.spec.quant
        key = (q["of"], entry.layer)
        if key not in self._fp8:
            self._fp8[key] = self._fp8_pair(entry)
        parts = self._fp8[key]
        t = parts.pop(q["role"])
        if not parts:
            del self._fp8[key]
        return t  # its shape is checked against the spec by weights._materialise

    @staticmethod
    def _parts(q: Any) -> list[tuple[str, tuple[int, int]]]:
        """(original param, [N_i, K]) of each part of a quantized weight: one, unless fusion merged several."""
        k = q["weight_shape"][1]
        return [(of, (rows, k)) for of, rows in q.get("parts") or ((q["of"], q["weight_shape"][0]),)]

    def _fp8_pair(self, entry: Any) -> dict[str, torch.Tensor]:
        q = entry.spec.quant
        sources = entry.spec.sources_for(entry.layer) if self.ckpt is not None else [None] * len(self._parts(q))
        weights, scales = [], []
        for (of, shape), src in zip(self._parts(q), sources, strict=True):
            w_q, scale = self._fp8_quantized(entry, of, shape, src)
            if q.get("parts") and q["granularity"] == "tensor":  # merged: one scale per row of this part
                scale = scale.reshape(1).expand(shape[0])
            weights.append(w_q)
            scales.append(scale)
        if len(weights) == 1:
            return {"weight": weights[0], "weight_scale": scales[0]}
        return {"weight": torch.cat(weights).contiguous(), "weight_scale": torch.cat(scales).contiguous()}

    def _fp8_quantized(self, entry: Any, of: str, shape: tuple[int, int], src: str | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Param `of`'s [N, K] weight (layer entry.layer) in e4m3 with its scale, as the recipe quantizes it."""
        q, spec = entry.spec.quant, entry.spec
        if self.ckpt is None:
            orig = ParamSpec(of, shape, q["dtype"], (), spec.block)
            name = entry.name[: -len(spec.local_name)] + orig.local_name  # "decoder.3.wq_fp8" -> "decoder.3.wq"
            w = self.random_weight(name, orig, entry.layer)
        else:
            w = self.ckpt.get(src)
            if w.dtype == FP8_DTYPE:
                return w.contiguous(), self._fp8_scale(entry, src, *shape)
        return fp8_quantize(w, q["granularity"], q["block"])

    def _fp8_scale(self, entry: Any, src: str, n: int, k: int) -> torch.Tensor:
        q, spec = entry.spec.quant, entry.spec
        names = fp8_scale_names(src)
        name = next((s for s in names if s in self.ckpt), None)
        if name is None:
            raise WeightError(f"checkpoint tensor '{src}' is fp8 but has no scale ('{names[0]}' or '{names[1]}')",
                              spec.loc)
        scale = self.ckpt.get(name).float()
        block_shape = self._scale_shape(q, n, k)
        have = _granularity_of(tuple(scale.shape), n)
        if scale.dim() == 2 and tuple(scale.shape) == block_shape and q["granularity"] == "block":
            have = "block"  # a single-tile weight's [1, 1] block scale looks per-tensor
        want_shape = {"tensor": (1,), "channel": (n,)}.get(have, tuple(scale.shape))
        if have != q["granularity"] or (have == "block" and tuple(scale.shape) != block_shape):
            recipe = {"tensor": "fp8", "channel": "fp8(per_channel=true)", "block": f"fp8(block={q['block']})"}
            raise WeightError(f"checkpoint '{name}' has shape {_fmt(scale.shape)} ({have} fp8 scales), but the recipe "
                              f"asks for {recipe[q['granularity']]} (scale {_fmt(block_shape)}); "
                              "kiln loads pre-quantized fp8 weights without re-quantizing them", spec.loc,
                              (f"set quantize.weights = {recipe.get(have, 'fp8(block=N)')}",))
        return scale.reshape(want_shape).contiguous()

    @staticmethod
    def _scale_shape(q: Any, n: int, k: int) -> tuple[int, ...]:
        """The scale shape of one [n, k] weight quantized as `q` says."""
        return {"tensor": (1,), "channel": (n,)}.get(q["granularity"]) or (-(-n // q["block"]), -(-k // q["block"]))

    def _int4_part(self, entry: Any) -> torch.Tensor:
        q, spec = entry.spec.quant, entry.spec
        src = spec.sources_for(entry.layer)[0]
        dtype = {"i32": torch.int32, "f16": torch.float16}[spec.dtype]
        if q["role"] == "g_idx" and src not in self.ckpt:
            return (torch.arange(spec.shape[0]) // q["group"]).to(torch.int32)
        parts = [self.ckpt.get(s) for s in spec.sources_for(entry.layer)]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.concat_dim)  # merged AWQ projections
        if q["role"] == "g_idx":
            g_idx = t.to(torch.int64)
            groups = q["weight_shape"][1] // q["group"]
            if tuple(t.shape) != spec.shape or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise WeightError(f"checkpoint '{src}' is not a g_idx of {spec.shape[0]} rows into {groups} groups",
                                  spec.loc)
        return t.to(dtype).contiguous()

    def _kv_source(self, entry: Any) -> str | None:
        spec = entry.spec
        names = [*spec.sources_for(entry.layer),
                 *(s.replace("{i}", str(entry.layer)) for s in spec.quant.get("alt_sources", ()))]
        return next((s for s in names if s in self.ckpt), None) if self.ckpt is not None else None

    def _kv_scale(self, entry: Any) -> torch.Tensor | None:
        spec = entry.spec
        src = self._kv_source(entry) if spec.quant["scales"] != "calibrate" else None
        if src is None:
            return None
        t = self.ckpt.get(src).float().reshape(-1)
        if t.numel() == 1:
            t = t.expand(spec.shape[0])
        if tuple(t.shape) != spec.shape or not bool((t > 0).all()):
            raise WeightError(f"checkpoint '{src}' ({_fmt(t.shape)}) is not a positive per-tensor or per-KV-head "
                              f"scale for {spec.shape[0]} KV heads", spec.loc)
        return t.contiguous()


# ---------------------------------------------------------------- KV scale calibration


def _without_kv_quantization(program: Program) -> Program:
    """The program with every fp8-KV attention reading plain K/V (same value ids): what calibration runs."""
    graphs = {}
    for name, graph in program.graphs.items():
        g = None
        for vid, node in graph.items():
            if node.op in ("attention", "mla_attention") and node.attrs.get("kv_dtype"):
                g = g or graph.copy()
                attrs = {k: v for k, v in node.attrs.items() if k != "kv_dtype"}
                plain = 3 if node.op == "attention" else 5
                sinks = node.inputs[5:] if node.op == "attention" else ()  # gpt-oss's sink logits stay
                g.replace(vid, node.with_(inputs=(*node.inputs[:plain], *sinks), attrs=attrs))
                for scale in node.inputs[plain:plain + 2]:
                    if not g.users(scale):
                        g.remove(scale)
        if g is not None:
            graphs[name] = g
    return program.with_graphs(graphs)


def calibration_tokens(program: Program, checkpoint_dir: str | Path | None) -> list[torch.Tensor]:
    """CALIBRATION_TEXT through the checkpoint's tokenizer, else seeded random token ids."""
    tok = Path(checkpoint_dir) / "tokenizer.json" if checkpoint_dir is not None else None
    if tok is not None and tok.is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tok)).encode(CALIBRATION_TEXT).ids[:CALIBRATION_TOKENS]
        if len(ids) >= 16:
            return [torch.tensor(ids, dtype=torch.int64)]
    vocab = next(spec.shape[0] for spec in program.params.values() if len(spec.shape) == 2)
    for _, node in program.entry.items():
        if node.op == "embedding":
            vocab = program.entry.node(node.inputs[1]).out.shape[0]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=g)]


def host_stable_scale(scale: torch.Tensor) -> torch.Tensor:
    """A calibrated f32 scale rounded up to the next bf16-representable value (at most 0.8 % larger: e4m3 keeps 3
    mantissa bits, so the quantization is as good; the largest magnitude still fits). Calibration runs the fp32
    reference forward, whose sums end in different last bits on different CPUs (AVX2 vs AVX-512 GEMMs): rounded,
    the same recipe writes the same bytes on both, as the artifact digests check."""
    bits = scale.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)  # positive floats: up to a multiple of 2^16 in the bits


@torch.no_grad()
def calibrate_kv_scales(program: Program, weights: Mapping[str, torch.Tensor],
                        tokens: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """absmax / 448 of every fp8-KV attention's K and V, per layer and KV head, and of every MLA layer's latent
    row [c_kv | k_pe] (one scale per layer), over `tokens` (the reference interpreter on unquantized KV).
    Returns artifact tensor name -> f32 [kv_heads] (MLA: [1])."""
    targets = {}
    for gname, graph in program.graphs.items():
        for vid, node in graph.items():
            if node.op == "attention" and node.attrs.get("kv_dtype"):
                targets[gname, vid] = tuple(program.params[graph.node(i).attrs["name"]] for i in node.inputs[3:5])
            elif node.op == "mla_attention" and node.attrs.get("kv_dtype"):
                targets[gname, vid] = (program.params[graph.node(node.inputs[5]).attrs["name"]],)
    amax: dict[str, torch.Tensor] = {}

    def observe(graph, vid, node, layer, args) -> None:
        specs = targets.get((graph.name, vid))
        if specs is None:
            return
        if node.op == "mla_attention":  # c_kv [T, L] and k_pe [T, 1, dr] share the one latent scale
            seen = [torch.stack((args[2].float().abs().amax(), args[3].float().abs().amax())).amax().reshape(1)]
        else:
            seen = [x.float().abs().amax(dim=(0, 2)) for x in args[1:3]]
        for spec, a in zip(specs, seen, strict=True):
            name = spec.layer_name(layer) if layer is not None else spec.name
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)

    plain = _without_kv_quantization(program)
    for ids in tokens:
        interpret(plain, weights, ids, observe=observe)
    return {name: host_stable_scale((a / FP8_MAX).clamp(min=1e-8)) for name, a in amax.items()}


# ---------------------------------------------------------------- static activation scale calibration


def _static_linears(program: Program) -> dict[tuple[str, str], str]:
    """(graph, value id) -> input-scale param name of every static-activation linear_fp8."""
    out = {}
    for gname, graph in program.graphs.items():
        for vid, node in graph.items():
            if node.op == "linear_fp8" and node.attrs.get("act") == "static_per_tensor":
                out[gname, vid] = graph.node(node.inputs[3]).attrs["name"]
    return out


def _weight_only(program: Program) -> Program:
    """The program with every static-activation linear_fp8 weight-only (same value ids): what calibration runs."""
    graphs = {}
    for name, graph in program.graphs.items():
        g = None
        for vid, node in graph.items():
            if node.op == "linear_fp8" and node.attrs.get("act") == "static_per_tensor":
                g = g or graph.copy()
                g.replace(vid, node.with_(inputs=(*node.inputs[:3], *node.inputs[4:]),
                                          attrs={**node.attrs, "act": "none"}))
                if not g.users(node.inputs[3]):
                    g.remove(node.inputs[3])
        if g is not None:
            graphs[name] = g
    return program.with_graphs(graphs)


@torch.no_grad()
def calibrate_input_scales(program: Program, weights: Mapping[str, torch.Tensor],
                           tokens: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """absmax / 448 of every static-activation linear_fp8's input over `tokens`, per layer (the reference
    interpreter with those linears weight-only and the KV cache unquantized, as llm-compressor's observers see
    unquantized activations).
    Returns artifact tensor name -> f32 [1]."""
    targets = _static_linears(program)
    amax: dict[str, torch.Tensor] = {}

    def observe(graph, vid, node, layer, args) -> None:
        pname = targets.get((graph.name, vid))
        if pname is None:
            return
        name = program.params[pname].layer_name(layer) if layer is not None else pname
        a = args[0].float().abs().amax().reshape(1)
        amax[name] = a if name not in amax else torch.maximum(amax[name], a)

    plain = _weight_only(_without_kv_quantization(program))  # KV scales, if calibrated too, come after
    for ids in tokens:
        interpret(plain, weights, ids, observe=observe)
    return {name: host_stable_scale((a / FP8_MAX).clamp(min=1e-12)) for name, a in amax.items()}


__all__ = ["CALIBRATION_TEXT", "QuantizedWeights", "calibrate_input_scales", "calibrate_kv_scales",
           "calibration_tokens"]
