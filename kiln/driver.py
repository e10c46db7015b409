"""The compile driver: recipe file → checked AST → IR → pass pipeline → artifact directory.

This is the one place that sees the DSL, the compiler, the passes and codegen together.
"""
from __future__ import annotations

import difflib
import hashlib
import math
import warnings as pywarnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.codegen import write_artifact
from kiln.compiler import PassContext, PassManager, Program
from kiln.compiler.instantiate import instantiate_model, section_values
from kiln.compiler.options import check_config_values, check_section_values
from kiln.compiler.pass_manager import PassError, load_pass
from kiln.compiler.report import format_report
from kiln.compiler.targets import TargetError, get_target
from kiln.dsl import ast as A
from kiln.dsl import load_recipe
from kiln.dsl.errors import KilnError, SourceError, SourceWarning


@dataclass
class CompileResult:
    program: Program
    options: dict[str, Any]
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


# Recipe options kiln parses but cannot build yet: compiling an artifact with them is an error at the
# option's location (never silently ignored). Planning (`--report` without `-o`) still models them.
_NOT_YET = {
    "lora": "LoRA adapters are not implemented yet",
    "disaggregate": "prefill/decode disaggregation is not implemented yet",
    "kv_cache.offload": "KV offload to CPU is not implemented yet",
}
_CODEGEN_TARGETS = ("cpu", "h100", "h200")


def check_buildable(recipe: A.RecipeDecl, options: dict[str, Any]) -> None:
    """Refuses, at the option's location, what this kiln cannot put into an artifact yet."""
    target = options.get("target", "cpu")
    if target not in _CODEGEN_TARGETS:
        s = _setting(recipe, "target")
        raise SourceError(f"code generation for target {target!r} is not implemented yet (supported: "
                          f"{', '.join(_CODEGEN_TARGETS)}); `kiln compile --report` without -o plans for it",
                          s.value.loc if s else recipe.loc)
    for sec in recipe.sections:
        if sec.name == "quantize":
            _check_quantize(recipe, sec, options)
        if sec.name in _NOT_YET and sec.entries:
            raise SourceError(_NOT_YET[sec.name], sec.entries[0].loc)
        for ent in sec.entries:
            key = f"{sec.name}.{getattr(ent, 'key', '')}"
            if key in _NOT_YET:
                raise SourceError(_NOT_YET[key], ent.loc)
            if sec.name == "parallel" and isinstance(ent, A.Setting) and ent.key in ("tp", "dp", "ep", "pp"):
                if not (isinstance(ent.value, A.Num) and ent.value.value == 1):
                    raise SourceError(f"parallel.{ent.key} > 1 is not implemented yet (single device only)",
                                      ent.value.loc)
            if sec.name == "cuda_graphs":
                _check_cuda_graphs(ent, target, options)
            if sec.name == "speculative":
                _check_speculative(ent)


# speculative { method = ...; tokens = N }: the draft heads kiln builds, and how many tokens each proposes
_DRAFT_METHODS = {"mtp": 1}


def _check_speculative(ent: A.Setting | A.PassHook) -> None:
    if not isinstance(ent, A.Setting):
        return
    if ent.key == "method":
        method = ent.value.id if isinstance(ent.value, A.Name) else None
        if method not in _DRAFT_METHODS:
            raise SourceError(f"speculative decoding method {method!r} is not implemented yet (kiln builds: "
                              f"{', '.join(_DRAFT_METHODS)}, a draft head compiled into the model)", ent.value.loc)
    elif ent.key == "draft":
        raise SourceError("speculative decoding with a separate draft model is not implemented yet; "
                          "method = mtp uses the model's own MTP head", ent.value.loc)
    elif ent.key == "tokens" and isinstance(ent.value, A.Num) and ent.value.value != 1:
        raise SourceError(f"speculative.tokens = {ent.value.value}: an MTP head proposes 1 token a step",
                          ent.value.loc)


def _check_cuda_graphs(ent: A.Setting, target: str, options: dict[str, Any]) -> None:
    """CUDA graphs are captured on GPU targets only, for buckets passes/cuda_graph_plan.py accepts."""
    from kiln.passes.cuda_graph_plan import DEFAULT_MAX_SEQS, parse_batch_sizes

    if target == "cpu":
        raise SourceError("cuda_graphs needs a GPU target (h100, h200); the cpu target runs decode eagerly",
                          ent.loc)
    try:
        parse_batch_sizes(options["cuda_graphs"][ent.key],
                          int(options.get("scheduler", {}).get("max_seqs", DEFAULT_MAX_SEQS)))
    except ValueError as e:
        raise SourceError(f"cuda_graphs.{ent.key}: {e}", ent.value.loc) from None


def _check_quantize(recipe: A.RecipeDecl, sec: A.Section, options: dict[str, Any]) -> None:
    """Each `quantize` entry names a scheme kiln implements (passes/quantize_*.py parse them)."""
    from kiln.passes.quantize_kv_cache import parse_kv_scheme
    from kiln.passes.quantize_weights import parse_weight_scheme

    values = options.get("quantize", {})
    for ent in sec.entries:
        if not isinstance(ent, A.Setting):
            continue
        try:
            if ent.key == "weights":
                scheme = parse_weight_scheme(values[ent.key])
                weights = _setting(recipe, "weights")
                if (scheme.kind in ("awq", "gptq") and weights is not None and isinstance(weights.value, A.Call)
                        and weights.value.func == "random"):
                    raise ValueError(f"{scheme.kind} loads a pre-quantized checkpoint (weights = \"hf:DIR\"); "
                                     "random weights have none (fp8 quantizes them at compile time)")
            else:
                parse_kv_scheme(values[ent.key])
        except ValueError as e:
            raise SourceError(f"quantize.{ent.key}: {e}", ent.value.loc) from None


def _check_compiled(recipe: A.RecipeDecl, program: Program) -> None:
    """What only the lowered program shows cannot be built: a speculative method the model has no head for."""
    spec = next((s for s in recipe.sections if s.name == "speculative"), None)
    method = next((e for e in (spec.entries if spec else ()) if getattr(e, "key", None) == "method"), None)
    if method is not None and method.value.id not in program.forward_graphs():
        raise SourceError(f"speculative method {method.value.id} needs a model with that draft head (a "
                          f"`forward {method.value.id}(...)`, e.g. deepseek_v3 with nextn >= 1; from-hf sets it "
                          "when the checkpoint has MTP weights)", method.value.loc)


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
                pm.remove(name)
    for ent in sec.entries if sec else ():
        if isinstance(ent, A.PassHook):
            _check_pass_name(pm, ent.anchor, ent.anchor_loc or ent.loc, target)
    for ent in sec.entries if sec else ():
        if isinstance(ent, A.PassHook):
            try:
                p = load_pass(ent.spec.value, search=[recipe_file.resolve().parent])
            except PassError as e:
                raise SourceError(str(e), ent.spec.loc) from None
            (pm.insert_after if ent.position == "after" else pm.insert_before)(ent.anchor, p)


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
    check_config_values(loaded.model, loaded.model_call, loaded.config)
    check_section_values(recipe)
    options = section_values(recipe)
    if target is not None:
        options["target"] = target
    target_name = options.get("target", "cpu")
    try:
        tgt = get_target(target_name)
    except TargetError as e:
        if target is not None:  # the flag / argument is wrong, not the recipe
            raise KilnError(f"--target: {e}") from None
        s = _setting(recipe, "target")
        raise SourceError(str(e), s.value.loc if s else recipe.loc) from None
    if out_dir is not None:
        check_buildable(recipe, options)
    model_setting = _setting(recipe, "model")
    call = model_setting.value
    if call.args:
        raise SourceError("pass model config by keyword: llama(hidden=4096, ...)", call.args[0].loc)
    program = instantiate_model(loaded.models[call.func], dict(call.kwargs), options.get("dtype", "fp32"), options)
    checkpoint, seed = resolve_weights(recipe, recipe_file)
    tokenizer = resolve_tokenizer(recipe, recipe_file, checkpoint)
    found = checkpoint_disagreements(loaded, checkpoint) if checkpoint is not None else []
    for w in found:
        pywarnings.warn(w, stacklevel=2)

    pm = PassManager.for_target(target_name)
    _apply_recipe_passes(pm, recipe, recipe_file, target_name)
    for position, anchor, p in extra_passes or []:
        (pm.insert_after if position == "after" else pm.insert_before)(anchor, p)
    ctx = PassContext(target=target_name, options=options, dump_dir=Path(dump_ir) if dump_ir else None)
    program = pm.run(program, ctx)
    pass_log = [r.to_json() for r in ctx.log]

    report = format_report(program, tgt, pass_log)
    manifest = None
    if out_dir is not None:
        _check_compiled(recipe, program)
        text = recipe_file.read_text(encoding="utf-8")
        manifest = write_artifact(program, Path(out_dir), checkpoint_dir=checkpoint, tokenizer_dir=tokenizer,
                                  seed=seed, recipe_text=text,
                                  recipe_file=recipe_file.name, pass_log=pass_log, kiln_version=_version(),
                                  progress=progress)
    return CompileResult(program, options, pass_log, Path(out_dir) if out_dir else None, manifest, report, found)


def recipe_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _version() -> str:
    from kiln import __version__

    return __version__
