"""The compile driver: recipe file → checked AST → IR → pass pipeline → artifact directory.

This is the one place that sees the DSL, the compiler, the passes and codegen together.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import shutil
import tempfile
import warnings as pywarnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.codegen import write_artifact
from kiln.codegen.artifact import DRAFT_DIR, EAGLE_DIR
from kiln.compiler import PassContext, PassManager, Program
from kiln.compiler.instantiate import instantiate_model
from kiln.compiler.options import RecipeOptions, check_config_values, recipe_options
from kiln.compiler.pass_manager import PassError, load_pass
from kiln.compiler.report import format_report
from kiln.compiler.support import MODEL_FREE_METHODS, check_supported
from kiln.compiler.targets import TargetError, get_target
from kiln.dsl import ast as A
from kiln.dsl import load_recipe
from kiln.dsl.errors import KilnError, SourceError, SourceWarning
from kiln.passes.pipeline import add_recipe_passes


@dataclass
class CompileResult:
    program: Program
    options: RecipeOptions
    pass_log: list[dict[str, Any]]
    artifact_dir: Path | None
    manifest: dict[str, Any] | None
    report: str
    warnings: list[SourceWarning] = field(default_factory=list)  # also issued through `warnings.warn`


def _setting(recipe: A.RecipeDecl, key: str) -> A.Setting | None:
    return next((s for s in recipe.settings if s.key == key), None)


def resolve_weights(recipe: A.RecipeDecl, recipe_file: Path) -> tuple[Path | None, int]:
    """`weights = "hf:DIR"` (relative to the recipe file) or `random(seed=N)` → (checkpoint dir, seed)."""
    s = _setting(recipe, "weights")
    if s is None:
        raise SourceError("recipe has no `weights = ...` (use \"hf:DIR\" or random(seed=0))", recipe.loc)
    v = s.value
    if isinstance(v, A.Call) and v.func == "random":
        seed = dict(v.kwargs).get("seed")
        return None, int(seed.value) if isinstance(seed, A.Num) else 0
    if isinstance(v, A.Str) and v.value.startswith("hf:"):
        return _hf_dir(v, recipe_file, "checkpoint"), 0
    raise SourceError('weights must be "hf:DIR" or random(seed=N)', v.loc)


def resolve_tokenizer(recipe: A.RecipeDecl, recipe_file: Path, checkpoint: Path | None) -> Path | None:
    """`tokenizer = "hf:DIR"` (relative to the recipe file), else the checkpoint's directory, else none."""
    s = _setting(recipe, "tokenizer")
    return checkpoint if s is None else _hf_dir(s.value, recipe_file, "tokenizer")


def _hf_dir(v: A.Str, recipe_file: Path, what: str) -> Path:
    path = Path(v.value[3:]).expanduser()
    if not path.is_absolute():
        path = (recipe_file.parent / path).resolve()
    if not path.is_dir():
        raise SourceError(f"{what} directory {path} does not exist", v.loc)
    return path


def _check_compiled(options: RecipeOptions, program: Program) -> None:
    """What cannot be put into an artifact though it can be planned: int4 weights without a checkpoint (they
    are loaded as published; a plan of random ones is fine), a speculative method the model has no head for."""
    w = options.quantize.weights
    if w is not None and w.kind in ("awq", "gptq") and options.random_weights:
        raise SourceError(f"quantize.weights: {w.kind} loads a pre-quantized checkpoint (weights = \"hf:DIR\"); "
                          "random weights have none (fp8 quantizes them at compile time)",
                          options.loc("quantize.weights"))
    method = options.speculative.method
    if method is not None and method not in MODEL_FREE_METHODS and method not in program.forward_graphs():
        raise SourceError(f"speculative method {method} needs a model with that draft head (a "
                          f"`forward {method}(...)`, e.g. deepseek_v3 with nextn >= 1; from-hf sets it "
                          "when the checkpoint has MTP weights)", options.loc("speculative.method"))
    if method in program.forward_graphs() and options.speculative.tokens > 1 and len(program.graphs[method].outputs) < 2:
        raise SourceError(f"speculative.tokens = {options.speculative.tokens}: the {method} head returns no hidden "
                          "state to be applied again on (`return logits(...), h`), so it proposes 1 token a step",
                          options.loc("speculative.tokens"))


def _compile_draft(options: RecipeOptions, recipe_file: Path, out: Path, progress: bool, program: Program) -> Path:
    """`speculative { method = draft; draft = "hf:DIR" }`: the draft checkpoint's recipe (`kiln recipe from-hf`
    with this recipe's target and dtype) compiled on its own, into a staging directory beside `out` whose `art/`
    becomes the artifact's `draft/` once the artifact is written (the runtime loads it as a second model).
    `method = eagle`: the EAGLE head's checkpoint, checked against `program`, becomes its `eagle/` instead."""
    from kiln.recipe_from_hf import recipe_from_hf

    loc = options.loc("speculative.draft")
    value = options.speculative.draft
    if not (isinstance(value, str) and value.startswith("hf:")):
        raise SourceError('speculative.draft: give the draft model as a checkpoint directory, draft = "hf:DIR"', loc)
    ckpt = Path(value[3:]).expanduser()
    if not ckpt.is_absolute():
        ckpt = (recipe_file.parent / ckpt).resolve()
    if not ckpt.is_dir():
        raise SourceError(f"draft checkpoint directory {ckpt} does not exist", loc)
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.draft-", dir=out.resolve().parent))
    if options.speculative.method == "eagle":
        try:
            _store_eagle(ckpt, program, stage / "art", loc, options)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        return stage
    try:
        recipe = stage / "draft.dsl"
        recipe.write_text(recipe_from_hf(ckpt, target=options.target, dtype=options.dtype, out_file=recipe,
                                         name="draft"), encoding="utf-8")
        compile(recipe, stage / "art", progress=progress)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage


def _store_eagle(ckpt: Path, program: Program, out: Path, loc, options: RecipeOptions) -> None:
    """An EAGLE head's checkpoint read as the runtime will serve it (runtime/core/speculative/eagle.py, eagle3.py),
    checked against the target, written to `out` (config.json, model.safetensors, without a copy of the target's
    embedding). EAGLE-1/2: the target must return its last hidden state and have an embedding, final norm and LM
    head of the head's width; kiln.json keeps the target's final-norm epsilon, which the head's input is
    normalised with. EAGLE-3: the target's width and vocabulary, and the decoder layers it reads among the
    target's (the runtime resolves them again from model.py's NUM_LAYERS, the same count)."""
    from safetensors.torch import save_file

    from kiln.codegen.render import decoder_layers
    from kiln.runtime.core.speculative.eagle3 import check_target, read_eagle3_checkpoint
    from kiln.runtime.core.speculative.eagle_head import is_eagle3, read_checkpoint

    entry, params = program.entry, program.params
    embed = params.get("embed")
    try:
        eagle3 = is_eagle3(ckpt)
        shape, weights = read_eagle3_checkpoint(ckpt) if eagle3 else read_checkpoint(ckpt)
    except ValueError as e:
        raise SourceError(str(e), loc) from None
    extra = None
    if eagle3:
        if embed is None or not decoder_layers(entry, program):
            raise SourceError(f"speculative method eagle: model {program.name} does not expose what an EAGLE-3 head "
                              "reads (decoder layers in a block, param embed)", loc)
        if options.parallel.world > 1:
            raise SourceError("speculative method eagle: an EAGLE-3 head on a parallel artifact (tp x dp = "
                              f"{options.parallel.world}) is not implemented yet: its auxiliary hidden states are "
                              "not gathered from the ranks (EAGLE-1/2 heads are)", loc)
        try:
            check_target(shape, ckpt, tuple(embed.shape)[-1], tuple(embed.shape)[0], decoder_layers(entry, program))
        except ValueError as e:
            raise SourceError(str(e), loc) from None
    else:
        if len(entry.outputs) < 2 or embed is None or "norm" not in params:
            raise SourceError(f"speculative method eagle: model {program.name} does not expose what an EAGLE head "
                              "reads (its last hidden state as a second output of `forward`, params embed and norm: "
                              "models/llama.dsl does)", loc)
        if tuple(embed.shape)[-1] != shape.hidden:
            raise SourceError(f"EAGLE checkpoint {ckpt}: hidden_size {shape.hidden}, the target's is "
                              f"{tuple(embed.shape)[-1]}", loc)
        hidden = entry.outputs[1]
        extra = {"target_norm_eps": next((n.attrs.get("eps") for _, n in entry.items()
                                          if n.op == "rms_norm" and n.inputs[0] == hidden), None)}
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head")}  # it reads the target's
    out.mkdir(parents=True)
    shutil.copyfile(ckpt / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in weights.items() if not k.startswith("embed")},
              str(out / "model.safetensors"))
    if extra is not None:
        (out / "kiln.json").write_text(json.dumps(extra), encoding="utf-8")


def check_lora_adapters(recipe: A.RecipeDecl, recipe_file: Path, options: RecipeOptions,
                        program: Program) -> dict[str, Path]:
    """The recipe's `lora { adapters = { name: "hf:DIR" } }` as directories, each read as the runtime will
    serve it (runtime/worker/lora.py: the PEFT config, target modules, ranks) against the compiled targets; an adapter
    that would be refused at serve time is an error at its place in the recipe now."""
    import torch

    from kiln.codegen.artifact import lora_targets
    from kiln.runtime.worker.lora import LoRAError, LoRATarget, read_adapter

    sec = next((s for s in recipe.sections if s.name == "lora"), None)
    entry = next((e for e in sec.entries if isinstance(e, A.Setting) and e.key == "adapters"), None) if sec else None
    if entry is None:
        return {}
    targets = [LoRATarget.from_manifest(t) for t in lora_targets(program)]
    out: dict[str, Path] = {}
    for name, value in entry.value.items:
        path = _hf_dir(value, recipe_file, f"adapter '{name}'")
        try:
            read_adapter(path, targets, options.lora.max_rank, torch.float32, name=name)
        except LoRAError as e:
            raise SourceError(f"adapter '{name}': {e}", value.loc) from None
        out[name] = path
    return out


def _apply_recipe_passes(pm: PassManager, recipe: A.RecipeDecl, recipe_file: Path, target: str) -> None:
    """The recipe's `passes { disable = [...]; after X: "mod:Class" }`, each error at its place in the recipe.
    Anchors and disabled names are checked against the pipeline before any pass module is imported; a module
    is found next to the recipe file first, then on sys.path."""
    sec = next((s for s in recipe.sections if s.name == "passes"), None)
    for ent in sec.entries if sec else ():
        if isinstance(ent, A.Setting) and ent.key == "disable":
            for item in ent.value.items:
                name = item.id if isinstance(item, A.Name) else item.value
                _check_pass_name(pm, name, item.loc, target)
                try:
                    pm.remove(name)
                except PassError as e:  # another pass requires it
                    raise SourceError(str(e), item.loc) from None
    for ent in sec.entries if sec else ():
        if isinstance(ent, A.PassHook):
            _check_pass_name(pm, ent.anchor, ent.anchor_loc or ent.loc, target)
    for ent in sec.entries if sec else ():
        if isinstance(ent, A.PassHook):
            try:
                p = load_pass(ent.spec.value, search=[recipe_file.resolve().parent])
            except PassError as e:
                raise SourceError(str(e), ent.spec.loc) from None
            try:
                (pm.insert_after if ent.position == "after" else pm.insert_before)(ent.anchor, p)
            except PassError as e:  # the position breaks an ordering a pass declares
                raise SourceError(str(e), ent.loc) from None


def _check_pass_name(pm: PassManager, name: str, loc: Any, target: str) -> None:
    if name not in pm.names:
        close = difflib.get_close_matches(name, pm.names, n=1)
        raise SourceError(f"no pass named '{name}' in the {target} pipeline"
                          + (f" — did you mean '{close[0]}'?" if close else ""), loc,
                          (f"the pipeline: {', '.join(pm.names)}",))


# the config.json key behind a model config value, where its name differs (for the warning's wording)
_HF_KEYS = {"vocab": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
            "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "ffn": "intermediate_size",
            "norm_eps": "rms_norm_eps", "max_position": "max_position_embeddings",
            "tie_embeddings": "tie_word_embeddings", "experts": "num_local_experts", "top_k": "num_experts_per_tok",
            "moe_ffn": "moe_intermediate_size"}


def checkpoint_disagreements(loaded: Any, checkpoint: Path) -> list[SourceWarning]:
    """Model config values of a recipe that differ from what the checkpoint's config.json says (read as
    `kiln recipe from-hf` reads it), each at the recipe's value or, for a default, at the model call. A checkpoint
    kiln cannot map, or of another model family, gives none: its weights are checked tensor by tensor anyway."""
    from kiln.recipe_from_hf import checkpoint_model_args

    try:  # without MTP: whether to build a checkpoint's draft head is the recipe's choice (from-hf --no-mtp)
        family, expected = checkpoint_model_args(checkpoint, mtp=False)
    except KilnError:
        return []
    call = loaded.model_call
    if family != call.func:
        return []
    given = dict(call.kwargs)
    out = []
    for key, want in expected.items():
        have = loaded.config.get(key)
        if have is None or _same(have, want):
            continue
        hf_key = _HF_KEYS.get(key, key)
        whose = "the recipe's value" if key in given else f"{call.func}'s default"
        out.append(SourceWarning(
            f"{key} = {have!r} ({whose}), but {checkpoint / 'config.json'} implies {key} = {want!r}"
            + (f" ({hf_key})" if hf_key != key else "") + "; the compiled model follows the recipe",
            given[key].loc if key in given else call.loc,
            ("`kiln recipe from-hf` writes a recipe with the checkpoint's values",)))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):  # a DSL list evaluates to a tuple
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int | float) or not isinstance(b, int | float):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def compile(recipe_path: str | Path, out_dir: str | Path | None = None, *, target: str | None = None,
            recipe_name: str | None = None, dump_ir: str | Path | None = None, progress: bool = True,
            extra_passes: list[tuple[str, str, Any]] | None = None) -> CompileResult:
    """Compiles a recipe. Without `out_dir` nothing is written (planning / `--report` only).

    `extra_passes`: (position "after"|"before", anchor pass name, Pass instance) inserted into the pipeline.
    """
    recipe_file = Path(recipe_path)
    loaded = load_recipe(str(recipe_file), recipe_name)
    recipe = loaded.recipe
    options = recipe_options(recipe, target=target)
    check_config_values(loaded.model, loaded.model_call, loaded.config)
    try:
        tgt = get_target(options.target)
    except TargetError as e:
        if target is not None:  # the flag / argument is wrong, not the recipe
            raise KilnError(f"--target: {e}") from None
        raise SourceError(str(e), options.loc("target", recipe.loc)) from None
    check_supported(tgt, options)  # with and without out_dir: a plan is made only for what could be built
    call = loaded.model_call
    if call.args:
        raise SourceError("pass model config by keyword: llama(hidden=4096, ...)", call.args[0].loc)
    program = instantiate_model(loaded.models[call.func], dict(call.kwargs), options.dtype, options.to_meta())
    checkpoint, seed = resolve_weights(recipe, recipe_file)
    tokenizer = resolve_tokenizer(recipe, recipe_file, checkpoint)
    found = checkpoint_disagreements(loaded, checkpoint) if checkpoint is not None else []
    for w in found:
        pywarnings.warn(w, stacklevel=2)

    pm = PassManager.for_target(tgt.name)
    add_recipe_passes(pm, options)
    _apply_recipe_passes(pm, recipe, recipe_file, tgt.name)
    for position, anchor, p in extra_passes or []:
        (pm.insert_after if position == "after" else pm.insert_before)(anchor, p)
    ctx = PassContext(target=tgt.name, options=options.to_meta(), dump_dir=Path(dump_ir) if dump_ir else None)
    program = pm.run(program, ctx)
    pass_log = [r.to_json() for r in ctx.log]

    report = format_report(program, tgt, pass_log)
    manifest = None
    if out_dir is not None:
        _check_compiled(options, program)
        text = recipe_file.read_text(encoding="utf-8")
        adapters = check_lora_adapters(recipe, recipe_file, options, program)
        draft = (_compile_draft(options, recipe_file, Path(out_dir), progress, program)
                 if options.speculative.draft else None)
        try:
            manifest = write_artifact(program, Path(out_dir), checkpoint_dir=checkpoint, tokenizer_dir=tokenizer,
                                      seed=seed, recipe_text=text, lora_adapters=adapters,
                                      recipe_file=recipe_file.name, pass_log=pass_log, kiln_version=_version(),
                                      progress=progress)
            if draft is not None:
                os.replace(draft / "art", Path(out_dir) / (EAGLE_DIR if options.speculative.method == "eagle"
                                                           else DRAFT_DIR))
        finally:
            if draft is not None:
                shutil.rmtree(draft, ignore_errors=True)
    return CompileResult(program, options, pass_log, Path(out_dir) if out_dir else None, manifest, report, found)


def recipe_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _version() -> str:
    from kiln import __version__

    return __version__
