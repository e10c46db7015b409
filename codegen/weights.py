"""Weight conversion: a Hugging Face safetensors checkpoint (or a seed) -> the artifact's weight shards.

Every ParamSpec is materialised for every layer: its checkpoint sources (`{i}` = the global layer index, the
layer's place in the layer schedule; `{e}` = expert, one tensor per expert stacked along dim 0) are read lazily
through `safetensors.safe_open`, checked against the declared shape, concatenated along `concat_dim`
(fused weights), cast to the param dtype, and written as `weights/rank0/model-0000k-of-0000n.safetensors`.
Output bytes depend only on the program and the checkpoint: tensor order, shard split and metadata are fixed.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from kiln.compiler.ir import DTYPE_BYTES, EXPERT_INDEX, ParamSpec, Program
from kiln.compiler.placement import Mesh, local_shape, mesh_of, param_placement, shard_tensor
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .errors import CheckpointError, CodegenError, WeightError
from .errors import fmt_shape as _fmt
from .quant_weights import (
    QuantizedWeights,
    calibrate_input_scales,
    calibrate_kv_scales,
    calibration_tokens,
    fp8_scale_names,
)

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
QUANT_DTYPES = {"fp8e4m3": torch.float8_e4m3fn, "i32": torch.int32}  # quantized params only (ParamSpec.quant)
TORCH_DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
SHARD_BYTES = 2 * 1024**3
WEIGHTS_DIR = "weights/rank0"


def rank_weights_dir(rank: int) -> str:
    """Where rank `rank`'s shards live in the artifact (rank 0: WEIGHTS_DIR)."""
    return f"weights/rank{rank}"
INDEX_FILE = "model.safetensors.index.json"
# An MXFP4 tensor X (OpenAI's gpt-oss experts) is stored as X_blocks (uint8, two e2m1 values a byte, 32 a block)
# and X_scales (uint8 e8m0, one a block), in [out, in] order; the float X of the model is [in, out].
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
INIT_STD = 0.02


# ---------------------------------------------------------------- reading a checkpoint


class Checkpoint:
    """The tensors of a checkpoint directory, opened lazily: shapes come from headers, data on `get`.

    Layouts: `model.safetensors`; sharded with `model.safetensors.index.json`; or any set of `*.safetensors`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self._handles: dict[Path, object] = {}
        self.file_of: dict[str, Path] = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
            files = {f: self._shard(index, f) for f in sorted(set(weight_map.values()))}
            return {name: files[f] for name, f in weight_map.items()}
        single = self.path / "model.safetensors"
        paths = [single] if single.is_file() else sorted(self.path.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(f"{self.path}: no safetensors weights (expected model.safetensors, "
                                  f"{INDEX_FILE}, or *.safetensors files)")
        file_of: dict[str, Path] = {}
        for p in paths:
            for name in self._open(p).keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if name in file_of:
                    raise CheckpointError(f"{self.path}: tensor '{name}' is in both {file_of[name].name} and {p.name}")
                file_of[name] = p
        return file_of

    def _shard(self, index: Path, name: str) -> Path:
        """A file the index names: one inside the checkpoint directory (symlinks resolved), never outside it."""
        root = self.path.resolve()
        path = (root / name).resolve()
        if not path.is_relative_to(root):
            raise CheckpointError(f"{index} names {name!r}, which is outside the checkpoint directory {root}; "
                                  "an index may only name files in its own directory")
        if not path.is_file():
            raise CheckpointError(f"{index} lists {name}, which is not in {self.path}")
        return path

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:  # empty, truncated, garbage, unreadable
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of or self.mxfp4(name)

    def mxfp4(self, name: str) -> bool:
        """Whether `name` is stored in MXFP4 (`<name>_blocks` + `<name>_scales`, gpt-oss's experts) instead."""
        return name not in self.file_of and f"{name}{MXFP4_BLOCKS}" in self.file_of \
            and f"{name}{MXFP4_SCALES}" in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        if self.mxfp4(name):  # blocks [..., out, G, 16] -> the float tensor, as its model holds it: [..., in, out]
            *lead, out, groups, nbytes = self._raw_shape(f"{name}{MXFP4_BLOCKS}")
            return (*lead, groups * nbytes * 2, out)
        return self._raw_shape(name)

    def _raw_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.file_of[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if self.mxfp4(name):
            from kiln.compiler.quant import mxfp4_dequantize

            blocks, scales = self.get(f"{name}{MXFP4_BLOCKS}"), self.get(f"{name}{MXFP4_SCALES}")
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
                raise CheckpointError(f"{self.path}: '{name}{MXFP4_BLOCKS}' {_fmt(blocks.shape)} {blocks.dtype} and "
                                      f"'{name}{MXFP4_SCALES}' {_fmt(scales.shape)} {scales.dtype} are no MXFP4 pair "
                                      "(uint8 blocks [..., G, 16] and uint8 e8m0 scales [..., G])")
            return mxfp4_dequantize(blocks, scales).transpose(-1, -2)  # bf16, exact
        file = self.file_of[name]
        try:
            return self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: tensor '{name}' cannot be read ({e})") from None

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype of a tensor ("BF16", "F8_E4M3", ...), from the header."""
        return self._open(self.file_of[name]).get_slice(name).get_dtype()

    def close_matches(self, name: str) -> list[str]:
        return difflib.get_close_matches(name, list(self.file_of), n=1, cutoff=0.75)


# ---------------------------------------------------------------- the conversion plan


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of the artifact: a param at a layer (None for top-level params)."""

    name: str  # artifact tensor name, block-local: "moe.0.w_down" is the moe block's layer 0
    spec: ParamSpec
    layer: int | None  # global layer index (`BlockSpec.global_layer`): what `{i}` in the sources means

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.spec.dtype]
        for d in self.spec.shape:
            n *= d
        return n

    def local_nbytes(self, program: Program, mesh: Mesh) -> int:
        """Bytes of one rank's shard (all ranks' shards are alike)."""
        n = DTYPE_BYTES[self.spec.dtype]
        for d in local_shape(self.spec.shape, param_placement(program, self.spec.name), mesh):
            n *= d
        return n


def weight_entries(program: Program) -> list[_Entry]:
    """Every artifact tensor in a fixed order: top-level params, then each block layer by layer."""
    entries = [_Entry(s.name, s, None) for s in program.params.values() if s.block is None]
    for block in program.blocks.values():
        specs = [s for s in program.params.values() if s.block == block.name]
        for i in range(block.count):
            entries.extend(_Entry(s.layer_name(i), s, block.global_layer(i)) for s in specs)
    for e in entries:
        if e.spec.dtype not in TORCH_DTYPES and not (e.spec.quant is not None and e.spec.dtype in QUANT_DTYPES):
            raise CodegenError(f"param '{e.spec.name}' has dtype {e.spec.dtype}; weight conversion writes only "
                               f"{', '.join(TORCH_DTYPES)} (quantized weights are not converted yet)", e.spec.loc)
    return entries


def total_weight_bytes(program: Program, aliases: Mapping[str, str] | None = None) -> int:
    """Bytes of the artifact's weights as stored: a tensor in `aliases` (stored once, under another name, by
    convert_weights) is not counted again."""
    dropped = set(aliases or ())
    return sum(e.nbytes for e in weight_entries(program) if e.name not in dropped)


def _where(entry: _Entry) -> str:
    return f"param '{entry.spec.name}'" + (f" (layer {entry.layer})" if entry.layer is not None else "")


def check_sources(entry: _Entry, ckpt: Checkpoint) -> None:
    """Raises WeightError unless every source exists and they concatenate to the declared shape."""
    spec = entry.spec
    sources = spec.sources_for(entry.layer)
    if not sources:
        raise WeightError(f"{_where(entry)} has no checkpoint source ('from \"...\"') and the recipe loads "
                          f"weights from {ckpt.path}", spec.loc)
    shapes = []
    for src, names in zip(sources, _source_tensors(entry), strict=True):
        for name in names:
            if name not in ckpt:
                near = ckpt.close_matches(name)
                notes = (f"did you mean '{near[0]}'?",) if near else ()
                raise WeightError(f"checkpoint tensor '{name}' for {_where(entry)} is not in {ckpt.path}", spec.loc,
                                  notes)
        if EXPERT_INDEX in src:
            per_expert = {ckpt.shape(n) for n in names}
            if len(per_expert) != 1:
                raise WeightError(f"the experts of '{src}' for {_where(entry)} differ in shape: "
                                  f"{', '.join(_fmt(sh) for sh in sorted(per_expert))}", spec.loc)
            shapes.append((len(names), *per_expert.pop()))
        else:
            shapes.append(ckpt.shape(src))
    want, dim = spec.shape, spec.concat_dim
    if spec.transposed:  # `from "a" transposed`: the checkpoint holds the last two dims swapped
        want = (*want[:-2], want[-1], want[-2])
    if len(sources) == 1:
        if shapes[0] != want:
            stored = f" (its {_fmt(spec.shape)} stored transposed)" if spec.transposed else ""
            raise WeightError(f"checkpoint tensor '{sources[0]}' has shape {_fmt(shapes[0])}, but {_where(entry)} "
                              f"expects {_fmt(want)}{stored}", spec.loc)
        return
    for src, shape in zip(sources, shapes, strict=True):
        others = tuple(d for k, d in enumerate(shape) if k != dim)
        if len(shape) != len(want) or others != tuple(d for k, d in enumerate(want) if k != dim):
            expected = _fmt(tuple("*" if k == dim else d for k, d in enumerate(want)))
            raise WeightError(f"checkpoint tensor '{src}' has shape {_fmt(shape)}, but {_where(entry)} (expected "
                              f"{_fmt(want)}, concatenated along dim {dim}) needs {expected}", spec.loc)
    if sum(s[dim] for s in shapes) != want[dim]:
        parts = ", ".join(f"'{s}' {_fmt(sh)}" for s, sh in zip(sources, shapes, strict=True))
        raise WeightError(f"checkpoint tensors {parts} concatenate along dim {dim} to "
                          f"{sum(s[dim] for s in shapes)}, but {_where(entry)} expects {_fmt(want)}", spec.loc)


def _source_tensors(entry: _Entry) -> list[tuple[str, ...]]:
    """Per source, the checkpoint tensors it reads: itself, or one per expert (`{e}`) to stack along dim 0."""
    experts = entry.spec.shape[0] if entry.spec.shape else 0
    return [tuple(src.replace(EXPERT_INDEX, str(e)) for e in range(experts)) if EXPERT_INDEX in src else (src,)
            for src in entry.spec.sources_for(entry.layer)]


FP8_CHECKPOINT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_SIZES = (128, 64, 256, 32, 16, 512)  # DeepSeek's 128 first: a weight of one tile fits any of them


def float_source(ckpt: Checkpoint, name: str, spec: ParamSpec) -> torch.Tensor:
    """Checkpoint tensor `name` as the float param `spec`: cast, or — for an fp8 tensor (a quantized checkpoint
    whose tensor this param reads unquantized, e.g. the experts of DeepSeek-V3's or Qwen3-MoE-FP8's checkpoints,
    which `quantize_weights` leaves float) — dequantized with its `<name>_scale` (per tensor or per row,
    compressed-tensors) or `<name>_scale_inv` (128x128 blocks, DeepSeek). A cast alone would read e4m3 codes
    as weights. Integer tensors (packed int4, int8) have no float meaning here: an error naming the tensor."""
    t = ckpt.get(name)
    dtype = TORCH_DTYPES[spec.dtype]
    if t.dtype.is_floating_point and t.dtype not in FP8_CHECKPOINT_DTYPES:
        return t.to(dtype)
    if t.dtype not in FP8_CHECKPOINT_DTYPES:
        raise WeightError(f"checkpoint tensor '{name}' is {str(t.dtype).removeprefix('torch.')}, but param "
                          f"'{spec.name}' is {spec.dtype} and reads it unquantized; a quantized checkpoint needs its "
                          "`quantize { weights = ... }` line (kiln recipe from-hf writes it)", spec.loc)
    scales = fp8_scale_names(name)
    scale_name = next((s for s in scales if s in ckpt), None)
    if scale_name is None:
        raise WeightError(f"checkpoint tensor '{name}' is fp8 but has no scale ('{scales[0]}' or '{scales[1]}') to "
                          f"dequantize it into param '{spec.name}' ({spec.dtype})", spec.loc)
    from kiln.compiler.quant import fp8_dequantize

    scale = ckpt.get(scale_name).float()
    n, k = t.shape if t.dim() == 2 else (t.shape[0], 1)
    if scale.numel() == 1:
        return fp8_dequantize(t.reshape(n, -1), scale.reshape(1)).reshape(t.shape).to(dtype)
    if tuple(scale.shape) in ((n,), (n, 1)):
        return fp8_dequantize(t.reshape(n, -1), scale.reshape(n)).reshape(t.shape).to(dtype)
    block = next((b for b in BLOCK_SIZES if scale.dim() == 2 and t.dim() == 2
                  and tuple(scale.shape) == (-(-n // b), -(-k // b))), None)
    if block is None:
        raise WeightError(f"checkpoint '{scale_name}' has shape {_fmt(scale.shape)}, which is no per-tensor, per-row "
                          f"or block scale of '{name}' {_fmt(t.shape)}", spec.loc)
    return fp8_dequantize(t, scale, block).to(dtype)


def _load(entry: _Entry, ckpt: Checkpoint) -> torch.Tensor:
    spec = entry.spec
    parts = [torch.stack([float_source(ckpt, n, spec) for n in names]) if EXPERT_INDEX in src
             else float_source(ckpt, src, spec)
             for src, names in zip(entry.spec.sources_for(entry.layer), _source_tensors(entry), strict=True)]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=entry.spec.concat_dim)
    if spec.transposed:
        t = t.transpose(-1, -2)
    if spec.offset:  # `from "..." + c`: Gemma's norms scale by 1 + w; added in fp32, then cast to the param dtype
        t = (t.float() + spec.offset).to(t.dtype)
    return t.contiguous()


# ---------------------------------------------------------------- random weights


def param_roles(program: Program) -> dict[str, str]:
    """"norm" for params read as a norm weight, "bias" for those read as a linear bias (from the graphs)."""
    roles: dict[str, str] = {}
    slots = {("rms_norm", 1): "norm", ("add_rms_norm", 2): "norm", ("linear", 2): "bias"}
    for graph in program.graphs.values():
        for vid in graph.order():
            node = graph.node(vid)
            for k, src in enumerate(node.inputs):
                p = graph.node(src)
                if p.op == "param" and (node.op, k) in slots:
                    roles[p.attrs["name"]] = slots[node.op, k]
    return roles


def _random(entry: _Entry, role: str | None, seed: int) -> torch.Tensor:
    """normal(0, 0.02) for matrices, ones for norm weights, zeros for biases; seeded per tensor name, so a
    tensor's values do not depend on which other params the program has."""
    spec, dtype = entry.spec, TORCH_DTYPES[entry.spec.dtype]
    if len(spec.shape) == 1 and role != "bias" and (role == "norm" or "norm" in spec.local_name):
        return torch.ones(spec.shape, dtype=dtype)
    if len(spec.shape) == 1:
        return torch.zeros(spec.shape, dtype=dtype)
    digest = hashlib.sha256(f"{seed}:{entry.name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.empty(spec.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=g).to(dtype)


# ---------------------------------------------------------------- writing


def _shards(entries: list[_Entry], max_bytes: int, sizes: list[int] | None = None) -> list[list[_Entry]]:
    """Consecutive entries in files of at most `max_bytes` (`sizes`: each entry's bytes in the file, a rank's
    shard; default its whole tensor)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e, n in zip(entries, sizes or [e.nbytes for e in entries], strict=True):
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards


def shard_names(n: int) -> list[str]:
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def _materialise(entries: list[_Entry], ckpt: Checkpoint | None, roles: dict[str, str], seed: int,
                 bar: tqdm, quant: QuantizedWeights | None = None,
                 ready: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    for e in entries:
        if ready is not None and e.name in ready:
            t = ready.pop(e.name)
        elif e.spec.quant is not None:
            t = quant.load(e)
            if t is None:
                what = {"kv_scale": "KV scale", "input_scale": "activation input_scale"}.get(e.spec.quant["role"], "scale")
                raise WeightError(f"{_where(e)}: no {what} in the checkpoint and none calibrated (calibration runs "
                                  "the model's main forward only)", e.spec.loc)
        else:
            t = _load(e, ckpt) if ckpt is not None else _random(e, roles.get(e.spec.name), seed)
        assert tuple(t.shape) == e.spec.shape, f"{e.name}: built {tuple(t.shape)}, declared {e.spec.shape}"
        bar.update(e.nbytes)
        yield e.name, t


def _with_fallback(entry: _Entry, ckpt: Checkpoint | None) -> _Entry:
    """The entry reading its fallback sources (`from "a" else "b"`) when the checkpoint lacks a source."""
    spec = entry.spec
    if not spec.fallback or ckpt is None or all(n in ckpt for names in _source_tensors(entry) for n in names):
        return entry
    return _Entry(entry.name, dataclasses.replace(spec, source=spec.fallback, fallback=()), entry.layer)


def _dedup(tensors: dict[str, torch.Tensor], entries: list[_Entry], seen: dict[tuple, str],
           aliases: dict[str, str], candidates: set[tuple]) -> dict[str, torch.Tensor]:
    """Drops a top-level tensor equal to one already written (DeepSeek's MTP layer carries copies of the embedding
    and the LM head), recording `aliases[name] = stored name`. Only shapes several top-level params share are
    hashed."""
    top = {e.name for e in entries if e.layer is None}
    for name in list(tensors):
        t = tensors[name]
        key = (tuple(t.shape), t.dtype)
        if name not in top or key not in candidates:
            continue
        digest = hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
        first = seen.setdefault((*key, digest), name)
        if first != name:
            aliases[name] = first
            del tensors[name]
    return tensors


def convert_weights(program: Program, checkpoint_dir: str | Path | None, out_dir: str | Path, *, seed: int = 0,
                    progress: bool = True, max_shard_bytes: int = SHARD_BYTES,
                    aliases: dict[str, str] | None = None) -> list[str]:
    """Writes every param of `program` for every layer to `out_dir/weights/rank0/`; returns the file names.

    A parallel program (compiler/placement.py) writes each rank r's shards to `weights/rank{r}/` instead: every
    tensor is built whole, as for one device, then cut by its param's placement (a vocabulary padded with zero
    rows); the ranks' files hold the same tensors under the same names, split into files alike.

    A top-level tensor identical to one written before it is stored once: `aliases` (when given) receives
    {dropped name: stored name}, which the manifest lists for the loader.

    `checkpoint_dir=None` writes deterministic random weights from `seed`. All sources are checked (present,
    right shape) before anything is read, so a bad checkpoint fails fast with a WeightError at the param's
    DSL declaration. Shards hold at most `max_shard_bytes` each (one larger tensor gets a shard of its own).
    """
    ckpt = Checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    entries = [_with_fallback(e, ckpt) for e in weight_entries(program)]
    roles = param_roles(program)
    quant = QuantizedWeights(program, ckpt, lambda name, spec, layer: _random(_Entry(name, spec, layer),
                                                                              roles.get(spec.name), seed))
    for e in entries:
        if e.spec.quant is not None:
            quant.check(e)
        elif ckpt is not None:
            check_sources(e, ckpt)
    mesh = mesh_of(program)
    wdirs = [Path(out_dir) / rank_weights_dir(r) for r in range(mesh.world)]
    for wdir in wdirs:
        wdir.mkdir(parents=True, exist_ok=True)
    placements = {e.name: param_placement(program, e.spec.name) for e in entries} if mesh.world > 1 else {}
    shards = _shards(entries, max_shard_bytes, [e.local_nbytes(program, mesh) for e in entries])
    names = shard_names(len(shards))
    aliases = {} if aliases is None else aliases
    shapes = [(e.spec.shape, TORCH_DTYPES.get(e.spec.dtype)) for e in entries if e.layer is None]
    candidates = {s for s in shapes if shapes.count(s) > 1}
    seen: dict[tuple, str] = {}
    show = progress and sys.stderr.isatty()
    with tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc="weights",
              disable=not show) as bar:
        ready = _calibrated(program, entries, ckpt, roles, seed, bar, quant, checkpoint_dir)
        for shard, name in zip(shards, names, strict=True):
            tensors = _dedup(dict(_materialise(shard, ckpt, roles, seed, bar, quant, ready)), shard, seen, aliases,
                             candidates)
            for rank, wdir in enumerate(wdirs):
                part = tensors if not placements else {
                    n: shard_tensor(t, placements[n], mesh, rank) for n, t in tensors.items()}
                save_file(part, str(wdir / name), metadata={"format": "pt"})
    return names


def _calibrated(program: Program, entries: list[_Entry], ckpt: Checkpoint | None, roles: dict[str, str], seed: int,
                bar: tqdm, quant: QuantizedWeights, checkpoint_dir: str | Path | None) -> dict[str, torch.Tensor] | None:
    """Every tensor, with the static activation scales and fp8 KV scales the checkpoint lacks calibrated
    (codegen/quant_weights.py), when some are missing; None (stream shard by shard) otherwise. Activation
    scales come first (the KV calibration run reads them). Calibration needs the whole model in memory."""
    scales = [e for e in entries if e.spec.quant is not None and e.spec.quant["role"] in ("kv_scale", "input_scale")]
    loaded = {e.name: quant.load(e) for e in scales}
    if all(t is not None for t in loaded.values()):
        return loaded or None
    others = [e for e in entries if e.name not in loaded]
    ready = dict(_materialise(others, ckpt, roles, seed, bar, quant))
    tokens = calibration_tokens(program, checkpoint_dir)
    for role, calibrate in (("input_scale", calibrate_input_scales), ("kv_scale", calibrate_kv_scales)):
        missing = {e.name for e in scales if e.spec.quant["role"] == role and loaded[e.name] is None}
        if missing:
            calibrated = calibrate(program, {**ready, **{n: t for n, t in loaded.items() if t is not None}}, tokens)
            loaded.update({name: calibrated[name] for name in missing if name in calibrated})
    ready.update({name: t for name, t in loaded.items() if t is not None})  # the rest: a located error later
    bar.reset()
    return ready


__all__ = [
    "SHARD_BYTES",
    "TORCH_DTYPES",
    "TORCH_DTYPE_NAMES",
    "WEIGHTS_DIR",
    "Checkpoint",
    "rank_weights_dir",
    "WeightError",
    "convert_weights",
    "param_roles",
    "shard_names",
    "total_weight_bytes",
    "weight_entries",
]
