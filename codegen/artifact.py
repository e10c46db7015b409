"""The artifact writer: a lowered Program (+ checkpoint, recipe) -> a self-contained serving directory.

    ART/manifest.json  __init__.py  __main__.py  model.py  kernels/{__init__,cpu}.py (GPU targets: + triton.py)
        (cpu target: + kernels/tvm.py, kernels/tvm_cpu/{cpu.so, kernels.py, build.json}: codegen/tvm_build.py)
        weights/rank0/model-0000k-of-0000n.safetensors  tokenizer/  recipe.dsl  ir.txt

Everything is written to a sibling temp directory and renamed into place at the end, so a failed compile
leaves no half artifact. The same inputs give byte-identical files: sorted JSON keys, no timestamps, no
absolute paths.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.compiler.ir import Attrs, Program, TensorType
from kiln.compiler.kv_layout import FP8_KV, kv_cache_nodes
from kiln.compiler.options import CUDA_GRAPH_PLAN as PLAN
from kiln.compiler.options import DEFAULT_MAX_MODEL_LEN, RecipeOptions, SchedulerOptions
from kiln.compiler.placement import (
    collectives,
    local_kv_layout,
    local_shape,
    lora_shard,
    mesh_of,
    param_placement,
    placement_of,
    rank_param_bytes,
)
from kiln.compiler.targets import Target, TargetError, get_target
from kiln.compiler.text import print_program
from kiln.dsl.errors import KilnError

from .emitters import KERNEL_MODULES
from .errors import CodegenError, TokenizerError
from .pooling import embedding_section
from .render import kernels_used, render_model, template_env, vocab_size
from .tvm_build import build_library
from .weights import TORCH_DTYPE_NAMES, WEIGHTS_DIR, convert_weights, rank_weights_dir, total_weight_bytes

SCHEMA_VERSION = 2  # runtime/manifest.py defines what a version holds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
KV_LAYOUT = ["num_blocks", 2, "block_size", "kv_heads", "head_dim"]
MLA_KV_LAYOUT = ["num_blocks", "block_size", "latent_dim"]  # per token [c_kv (kv_lora_rank) | k_pe (rope dim)]


def _jsonable(v: Any) -> Any:
    if isinstance(v, Attrs | Mapping):
        return {str(k): _jsonable(v[k]) for k in v}
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)


def _section(meta: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = meta.get(key)
    return _jsonable(v) if isinstance(v, Mapping) else {}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: invalid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list | tuple) else [int(v)]


def _runtime_section(program: Program, hf_config: dict, gen_config: dict, max_model_len: int) -> dict[str, Any]:
    bos = gen_config.get("bos_token_id", hf_config.get("bos_token_id"))
    eos = _token_ids(gen_config.get("eos_token_id"))
    eos += [t for t in _token_ids(hf_config.get("eos_token_id")) if t not in eos]
    return {"vocab_size": vocab_size(program), "max_model_len": max_model_len, "bos_token_id": bos,
            "eos_token_ids": eos}


def _options(program: Program) -> RecipeOptions:
    return RecipeOptions.from_meta(program.meta)


def _kv_cache_sizing(program: Program) -> dict[str, Any]:
    """The recipe's kv_cache {block_size, memory_fraction, num_blocks, offload} and how the runtime sizes the pool:
    `num_blocks` when the recipe fixes it, else the target's `pool_bytes` (cpu), else (null) from the device's
    memory at load (compiler/kv_layout.py plan_kv_pool; the report predicts the same)."""
    kv = _options(program).kv_cache
    target = _target(program)
    return {"block_size": kv.block_size, "memory_fraction": float(kv.memory_fraction), "num_blocks": kv.num_blocks,
            "pool_bytes": target.kv_pool_bytes if kv.num_blocks is None else None,
            **({"offload_bytes": kv.offload} if kv.offload is not None else {})}  # written only when set


def _target(program: Program) -> Target:
    name = str(program.meta.get("target", "cpu"))
    try:
        return get_target(name)
    except TargetError as e:
        raise CodegenError(str(e), None) from None


# Options newer than an artifact format are written only when a recipe sets them otherwise than the default
# (the runtime reads their absence as the default), so artifacts that do not use them stay byte-identical.
def _scheduler_section(options: RecipeOptions) -> dict[str, Any]:
    section = dataclasses.asdict(options.scheduler)
    if section["kv_reserve"] == SchedulerOptions.kv_reserve:
        del section["kv_reserve"]
    return section


def _serve_section(options: RecipeOptions) -> dict[str, Any]:
    serve = options.serve
    section: dict[str, Any] = {"host": serve.host, "port": serve.port, "served_name": serve.served_name}
    if serve.reasoning_effort:
        section["reasoning_effort"] = dict(serve.reasoning_effort)
    return section


def _kv_cache_section(program: Program) -> dict[str, Any]:
    """compiler/kv_layout.py's geometry in the manifest's words. fp8 caches are e4m3 with scales: per layer and
    KV head (params `*.k_scale`, `*.v_scale`), or one per MLA layer (`*.kv_scale`)."""
    kv = local_kv_layout(program)  # what each rank allocates: its KV heads (the whole layout on one device)
    dtype = "float8_e4m3fn" if kv.dtype == FP8_KV else TORCH_DTYPE_NAMES[program.dtype]
    if kv.kind == "mla":
        geometry = {"kv_lora_rank": kv.kv_lora_rank, "qk_rope_head_dim": kv.rope_dim, "latent_dim": kv.latent_dim,
                    "layout": MLA_KV_LAYOUT}
    else:
        geometry = {"kv_heads": kv.kv_heads, "head_dim": kv.head_dim, "layout": KV_LAYOUT}
    return {"num_layers": kv.num_layers, **geometry, "dtype": dtype, "bytes_per_token": kv.bytes_per_token,
            **_kv_cache_sizing(program)}


def _drafts_section(program: Program) -> dict[str, Any]:
    """The named forwards (draft heads) the runtime may call after `forward(..., return_hidden=True)`: model.py
    method, and which of the KV caches (a contiguous range after the entry's) are theirs."""
    out: dict[str, Any] = {}
    first = len(kv_cache_nodes(program, "entry"))
    for name in program.forward_graphs()[1:]:
        n = len(kv_cache_nodes(program, name))
        out[name] = {"method": name, "first_kv_layer": first, "num_kv_layers": n,
                     "num_hidden": len(program.graphs[name].inputs) - 1,
                     "chains": len(program.graphs[name].outputs) > 1}
        first += n
    return out


def kernel_params(program: Program) -> dict[str, Any]:
    """What kernel templates are rendered for: the target, the attention shape (first GQA/MHA attention; the
    triton library picks its tiles from it) and the activation dtype. Extra keys are ignored by a template."""
    heads = None
    mesh = mesh_of(program)
    for graph, node in kv_cache_nodes(program):
        qn, kn = graph.node(node.inputs[0]), graph.node(node.inputs[1])
        if node.op == "attention" and isinstance(qn.out, TensorType) and isinstance(kn.out, TensorType):
            # a rank's heads: the kernels of a parallel artifact run on its shards
            q, k = (local_shape(n.out.shape, placement_of(n), mesh) for n in (qn, kn))
            heads = (int(q[-1]), int(q[-2]), int(k[-2]))
            break
    head_dim, num_heads, num_kv_heads = heads or (128, 1, 1)
    target = _target(program)
    unknown = [m for m in target.kernel_modules if m not in KERNEL_MODULES]
    if unknown:
        raise CodegenError(f"target {target.name!r} names kernel libraries {unknown} codegen has no template for "
                           f"(known: {', '.join(KERNEL_MODULES)})", None)
    return {"target": target.name, "kernel_modules": target.kernel_modules, "head_dim": head_dim, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
            "dtype": TORCH_DTYPE_NAMES[program.dtype],
            "block_size": _kv_cache_sizing(program)["block_size"],
            "lora": any(n.op == "lora" for g in program.graphs.values() for _, n in g.items())}


def resolve_max_model_len(program: Program, max_model_len: int | None, hf_config: Mapping[str, Any]) -> int:
    """The argument, else the recipe's serve.max_model_len, else the model config's max_position (or the
    checkpoint's max_position_embeddings), else 4096."""
    for v in (max_model_len, _options(program).serve.max_model_len,
              program.config.get("max_position"), hf_config.get("max_position_embeddings")):
        if v is not None:
            return int(v)
    return DEFAULT_MAX_MODEL_LEN


def _cuda_graphs_section(program: Program, max_model_len: int) -> dict[str, Any]:
    """The plan, with block_tables sized for the artifact's max_model_len (which may come from the checkpoint's
    config, which the pass did not see)."""
    plan = _section(program.meta, PLAN)
    max_blocks = -(-max_model_len // int(plan["block_size"]))
    if max_blocks != plan["max_blocks_per_seq"]:
        buffers = dict(plan["static_buffers"])
        table = buffers["block_tables"]
        buffers["block_tables"] = {**table, "shape": [table["shape"][0], max_blocks]}
        plan = {**plan, "max_model_len": max_model_len, "max_blocks_per_seq": max_blocks,
                "static_buffers": buffers, "estimated_bytes": plan["estimated_bytes"]
                + 4 * table["shape"][0] * (max_blocks - plan["max_blocks_per_seq"])}
    return plan


def weights_index(wdir: Path, files: list[str]) -> dict[str, Any]:
    """What the loader checks the weight files against: each file's sha256 and every tensor's file, safetensors
    dtype and shape (read back from the written headers)."""
    from safetensors import safe_open

    digests: dict[str, str] = {}
    tensors: dict[str, dict[str, Any]] = {}
    for name in files:
        h = hashlib.sha256()
        with open(wdir / name, "rb") as f:
            while chunk := f.read(16 * 2**20):
                h.update(chunk)
        digests[name] = h.hexdigest()
        with safe_open(str(wdir / name), framework="pt") as f:
            for t in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                sl = f.get_slice(t)
                tensors[t] = {"file": name, "dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
    return {"sha256": digests, "tensors": dict(sorted(tensors.items()))}


def _parallel_section(program: Program, ranks: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The mesh, every param's global shape, placement and per-rank shape, the experts each rank holds, the
    collectives of the layer schedule, and each rank's weight files (`ranks[r]`: weights/rank{r}/)."""
    mesh = mesh_of(program)
    params = {}
    for spec in program.params.values():
        placement = param_placement(program, spec.name)
        params[spec.name] = {"shape": list(spec.shape), "placement": str(placement),
                             "local_shape": list(local_shape(spec.shape, placement, mesh))}
    vocab = vocab_size(program)
    padded = max((seg.total_units for spec in program.params.values()
                  for shard in param_placement(program, spec.name).shards for seg in shard.segments
                  if seg.padded), default=vocab)
    from .render import expert_placement

    return {**mesh.to_json(), "vocab": {"size": vocab, "padded": padded}, "params": params,
            "experts": expert_placement(program), "collectives": [c.to_json() for c in collectives(program)],
            "rank_weight_bytes": rank_param_bytes(program, mesh), "ranks": ranks or []}


def build_manifest(program: Program, *, kiln_version: str, recipe_hash: str, max_model_len: int,
                   hf_config: dict, gen_config: dict, weight_files: list[str], has_tokenizer: bool,
                   pass_log: list[dict], weights: dict[str, Any] | None = None,
                   rank_weights: list[dict[str, Any]] | None = None,
                   embedding: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of `program` (runtime/manifest.py is its schema). `weights`: `weights_index` of the written
    files, and `aliases` when some tensors are stored once under another name. A parallel program: `weights`
    is rank 0's, `rank_weights` every rank's (the `parallel` section)."""
    if program.dtype not in TORCH_DTYPE_NAMES:
        raise CodegenError(f"program dtype {program.dtype} is not one of {', '.join(TORCH_DTYPE_NAMES)}", None)
    options = _options(program)
    return {
        "schema_version": SCHEMA_VERSION,
        "kiln_version": kiln_version,
        "recipe_hash": recipe_hash,
        "target": _target(program).name,
        "device": _target(program).device,
        "dtype": TORCH_DTYPE_NAMES[program.dtype],
        "model": {"name": program.name, "config": _jsonable(program.config)},
        "runtime": _runtime_section(program, hf_config, gen_config, max_model_len),
        # task = embed: the model returns hidden rows, pooled as this says (codegen/pooling.py); absent otherwise
        **({"task": "embed", "embedding": embedding} if embedding is not None else {}),
        "kv_cache": _kv_cache_section(program),
        "scheduler": _scheduler_section(options),
        "serve": _serve_section(options),
        # what `kiln serve --disaggregate` starts (runtime/disagg); absent when the recipe has no disaggregate
        # section (so such artifacts are byte-identical to those of a kiln without disaggregation)
        **({"disaggregate": dataclasses.asdict(options.disaggregate)} if "disaggregate" in options.set_sections
           else {}),
        "weights": {"dir": WEIGHTS_DIR, "files": list(weight_files), **(weights or {}),
                    "total_bytes": total_weight_bytes(program, (weights or {}).get("aliases")) if mesh_of(program).world == 1
                    else _index_bytes(weights or {"tensors": {}})},
        # a parallel program: the mesh and what every rank holds (compiler/placement.py)
        **({"parallel": _parallel_section(program, rank_weights)} if mesh_of(program).world > 1 else {}),
        "tokenizer": {"dir": "tokenizer"} if has_tokenizer else None,
        "entry": {"module": "model", "class": "Model"},
        "params": [{"name": s.name, "shape": list(s.shape), "dtype": TORCH_DTYPE_NAMES.get(s.dtype, s.dtype),
                    "source": list(s.source)} for s in program.params.values()],
        "kernels": kernels_used(program),
        "passes": _jsonable(list(pass_log)),
        # GPU targets: the cuda_graph_plan pass's capture plan (runtime/worker/graph_runner.py follows it)
        **({"cuda_graphs": _cuda_graphs_section(program, max_model_len)} if PLAN in program.meta else {}),
        # draft heads (named forwards, e.g. DeepSeek MTP) for speculative decoding, only when there are some;
        # `speculative.method` (the recipe's) turns decoding with one on by default
        **({"drafts": drafts} if (drafts := _drafts_section(program)) else {}),
        "speculative": {"method": options.speculative.method, "num_tokens": options.speculative.tokens,
                        **({"draft_model": {"draft": DRAFT_DIR, "eagle": EAGLE_DIR}[options.speculative.method]}
                           if options.speculative.method in ("draft", "eagle") else {})},
        # multi-LoRA (recipe `lora { }`): the lora_injection pass's adapted linears and the compiled-in adapters
        **({"lora": _lora_section(program, options)} if "lora" in options.set_sections else {}),
        # the recipe's `quantize` values as written (readers: humans)
        "quantization": {"weights": options.quantize.spelling.get("weights"),
                         "kv_cache": options.quantize.spelling.get("kv_cache")},
    }


LORA_DIR = "lora"
DRAFT_DIR = "draft"  # speculative { method = draft }: the draft model's own artifact (kiln/driver.py compiles it)
EAGLE_DIR = "eagle"  # speculative { method = eagle }: the EAGLE head's checkpoint (runtime/core/speculative/eagle.py)


def lora_targets(program: Program) -> list[dict[str, Any]]:
    """The linears the lora_injection pass adapted (its `lora` nodes), in graph order: the runtime's adapter
    slots are shaped by them (runtime/worker/lora.py)."""
    out: list[dict[str, Any]] = []
    mesh = mesh_of(program)
    for block in program.blocks.values():
        graph = program.graphs[block.graph]
        for _, node in graph.items():
            if node.op == "lora":
                x = graph.node(node.inputs[0]).out
                shard = lora_shard(graph, node, mesh)  # a tensor-parallel program: each rank's slice
                out.append({"name": node.attrs["target"], "block": block.name, "num_layers": block.count,
                            "first_layer": block.first_layer, "in_features": int(x.shape[-1]),
                            "modules": list(node.attrs["modules"]), "rows": list(node.attrs["rows"]),
                            **({"shard": shard} if shard else {})})
    return out


def _lora_section(program: Program, options: RecipeOptions) -> dict[str, Any]:
    return {"max_loras": options.lora.max_loras, "max_rank": options.lora.max_rank,
            "targets": lora_targets(program),
            "adapters": {name: f"{LORA_DIR}/{name}" for name in options.lora.adapters}}


_SAFETENSORS_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1, "I8": 1}


def _index_bytes(index: Mapping[str, Any]) -> int:
    """Bytes of the tensors a `weights_index` lists (one rank's files)."""
    return sum(math.prod(t["shape"]) * _SAFETENSORS_BYTES[t["dtype"]] for t in index["tensors"].values())


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def _check_destination(out: Path) -> None:
    if out.is_file() or out.is_symlink():
        raise KilnError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise KilnError(f"{out} exists, is not empty and is not a kiln artifact; refusing to overwrite it")


def _install(tmp: Path, out: Path) -> None:
    """Moves the finished artifact into place, replacing an older artifact at `out`."""
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def tokenizer_files(tokenizer_dir: Path, vocab_size: int) -> list[str]:
    """The tokenizer files of `tokenizer_dir` an artifact carries, each checked as the runtime will read it
    (a tokenizer that loads at compile time loads at serve time); [] when the directory has no tokenizer.json.
    Raises TokenizerError naming the file."""
    names = [n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if "tokenizer.json" not in names:
        return []
    from tokenizers import Tokenizer

    file = tokenizer_dir / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception on any malformed file
        raise TokenizerError(f"{file}: not a tokenizers file ({str(e).splitlines()[0][:200]})") from None
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise TokenizerError(f"{file}: {tok.get_vocab_size(with_added_tokens=True)} tokens, more than the model's "
                             f"vocabulary of {vocab_size}: token ids past {vocab_size - 1} would have no embedding")
    for name in names:
        if name.endswith(".json") and name != "tokenizer.json":
            path = tokenizer_dir / name
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{path}: invalid JSON ({e})") from None
            if not isinstance(data, dict):
                raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    template = _chat_template(tokenizer_dir)
    if template is not None:
        import jinja2

        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{tokenizer_dir}: the chat template does not parse (line {e.lineno}: "
                                 f"{e.message})") from None
    return names


def _chat_template(tokenizer_dir: Path) -> str | None:
    """The chat template the runtime renders: chat_template.jinja, else tokenizer_config.json's."""
    if (tokenizer_dir / "chat_template.jinja").is_file():
        return (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(tokenizer_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def write_artifact(program: Program, out_dir: str | Path, *, checkpoint_dir: str | Path | None, seed: int = 0,
                   recipe_text: str, recipe_file: str, pass_log: list[dict], kiln_version: str,
                   max_model_len: int | None = None, progress: bool = True,
                   tokenizer_dir: str | Path | None = None,
                   lora_adapters: dict[str, Path] | None = None) -> dict[str, Any]:
    """Writes the serving artifact of a lowered `program` to `out_dir` and returns its manifest.

    `program` is typed and kernel-selected (every compute node has attrs["kernel"]); `program.meta` may carry
    the recipe's `target`, `kv_cache` {block_size, memory_fraction, num_blocks}, `scheduler` {...} and
    `serve` {max_model_len}. `checkpoint_dir=None` writes random weights from `seed`. The tokenizer comes from
    `tokenizer_dir` (default: the checkpoint's directory). Raises a KilnError (CodegenError, WeightError,
    CheckpointError, TokenizerError) on anything that cannot be compiled; then nothing is left.
    """
    out = Path(out_dir)
    _check_destination(out)
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else ckpt
    hf_config = _read_json(ckpt / "config.json") if ckpt else {}
    gen_config = _read_json(ckpt / "generation_config.json") if ckpt else {}
    recipe_hash = hashlib.sha256(recipe_text.encode("utf-8")).hexdigest()
    max_len = resolve_max_model_len(program, max_model_len, hf_config)
    embedding = None
    if _options(program).task == "embed":  # the entry's output is hidden_rows (passes/embed_output.py)
        out_type = program.entry.node(program.entry.outputs[0]).out
        embedding = embedding_section(ckpt, out_type.shape[-1], hf_config)
    model_py = render_model(program, kiln_version=kiln_version, recipe_hash=recipe_hash, max_model_len=max_len,
                            recipe_file=recipe_file)
    probe = build_manifest(program, kiln_version=kiln_version, recipe_hash=recipe_hash, max_model_len=max_len,
                           hf_config=hf_config, gen_config=gen_config, weight_files=[], has_tokenizer=False,
                           pass_log=pass_log, embedding=embedding)  # fails before the (slow) weight conversion if it cannot be made
    tok_files = tokenizer_files(tok_dir, probe["runtime"]["vocab_size"]) if tok_dir is not None else []

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        env = template_env()
        _write(tmp / "model.py", model_py)
        for name, template in (("__init__.py", "__init__.py.j2"), ("__main__.py", "__main__.py.j2"),
                               ("kernels/__init__.py", "kernels_init.py.j2")):
            _write(tmp / name, env.get_template(template).render(kiln_version=kiln_version,
                                                                 program_name=program.name))
        params = kernel_params(program)
        for namespace in sorted(params["kernel_modules"]):
            template = KERNEL_MODULES[namespace][0]
            _write(tmp / "kernels" / f"{namespace}.py", env.get_template(template).render(kiln_version=kiln_version,
                                                                                           **params))
        build_library(kernels_used(program), params, tmp / "kernels", env=env, kiln_version=kiln_version)
        _write(tmp / "recipe.dsl", recipe_text)
        _write(tmp / "ir.txt", print_program(program))
        for name, src in (lora_adapters or {}).items():  # PEFT files as published: the runtime reads them
            (tmp / LORA_DIR / name).mkdir(parents=True)
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copyfile(src / file, tmp / LORA_DIR / name / file)
        for name in tok_files:
            (tmp / "tokenizer").mkdir(exist_ok=True)
            shutil.copyfile(tok_dir / name, tmp / "tokenizer" / name)
        aliases: dict[str, str] = {}  # tensors stored once under another name (e.g. DeepSeek MTP's embedding)
        files = convert_weights(program, ckpt, tmp, seed=seed, progress=progress, aliases=aliases)
        index = weights_index(tmp / WEIGHTS_DIR, files)
        aliases = dict(sorted(aliases.items()))
        world = mesh_of(program).world
        ranks = None
        if world > 1:
            ranks = []
            for r in range(world):
                rank_index = weights_index(tmp / rank_weights_dir(r), files)
                ranks.append({"dir": rank_weights_dir(r), "files": list(files), **rank_index, "aliases": aliases,
                              "total_bytes": _index_bytes(rank_index)})
        manifest = build_manifest(program, kiln_version=kiln_version, recipe_hash=recipe_hash, max_model_len=max_len,
                                  hf_config=hf_config, gen_config=gen_config, weight_files=files,
                                  has_tokenizer=bool(tok_files), pass_log=pass_log,
                                  weights={**index, "aliases": aliases}, rank_weights=ranks, embedding=embedding)
        _write(tmp / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700; an artifact is an ordinary directory
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


__all__ = ["SCHEMA_VERSION", "build_manifest", "kernel_params", "resolve_max_model_len", "write_artifact"]
