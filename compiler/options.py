"""The recipe's options: one typed dataclass per section with its defaults, filled once from the AST with the
location of every value, and the ranges of values.

`recipe_options(recipe)` is the one place recipe defaults live: the driver, the passes (through
`RecipeOptions.from_meta(program.meta)`), codegen and the report read them from here, and the manifest carries
the filled-in values, so the runtime holds none of its own. A default that depends on the target (the
scheduler's step budget) is the target's (compiler/targets.py), filled in here too. Adding a recipe key is a
field here (and its syntax check in dsl/check.py) plus the code that uses it.

Ranges: a value that type-checks can still compile to an artifact that cannot run: `rope_theta = 0` (an
infinite rotary frequency), `norm_eps = -1` (a NaN norm), `max_position = 1000000000` (a rotary table of tens
of GB allocated at load). Every model config value a bundled model names is range-checked here; every float
must be finite whatever its name.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.compiler.targets import TARGETS
from kiln.dsl import ast as A
from kiln.dsl import eval_expr
from kiln.dsl.check import did_you_mean, key_loc, literal
from kiln.dsl.errors import Loc, SourceError
from kiln.dsl.evaluate import type_name

# program.meta key of the CUDA-graph capture plan (passes/cuda_graph_plan.py writes it, codegen and the report
# read it; the manifest's `cuda_graphs` section)
CUDA_GRAPH_PLAN = "cuda_graph_plan"

# max_model_len when neither the recipe (serve.max_model_len), the model (max_position) nor the checkpoint say
DEFAULT_MAX_MODEL_LEN = 4096

# The largest context kiln builds: the rotary tables of model.py hold max_model_len positions (fp32, in memory
# from load); 2^24 covers the longest published contexts (10M tokens) at ~8 GiB for head_dim 128.
MAX_POSITIONS = 2**24


@dataclass(frozen=True, slots=True)
class Range:
    """lo < value (or lo <= value with `lo_inclusive`), value <= hi (or < hi when not `hi_inclusive`)."""

    lo: float | None = None
    hi: float | None = None
    lo_inclusive: bool = False
    hi_inclusive: bool = True
    why: str = ""

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (v == self.lo and not self.lo_inclusive)):
            return False
        return self.hi is None or v < self.hi or (v == self.hi and self.hi_inclusive)

    def describe(self) -> str:
        lo = "" if self.lo is None else f"{'>=' if self.lo_inclusive else '>'} {fmt_number(self.lo)}"
        hi = "" if self.hi is None else f"{'<=' if self.hi_inclusive else '<'} {fmt_number(self.hi)}"
        return " and ".join(p for p in (lo, hi) if p)


def fmt_number(v: float) -> str:
    """1,000,000,000 for integral values, 1e-05 otherwise."""
    return f"{int(v):,}" if float(v).is_integer() and abs(v) < 1e18 else f"{v:g}"


# model config parameters, by the name the bundled models (models/*.dsl) give them
CONFIG_RANGES: dict[str, Range] = {
    "rope_theta": Range(0, why="the rotary base: inverse frequencies are theta^(-2i/d)"),
    "norm_eps": Range(0, 1, hi_inclusive=False, why="added to the mean square before its square root"),
    "max_position": Range(1, MAX_POSITIONS, lo_inclusive=True, why="positions the rotary tables hold"),
    "rope_original_max_position": Range(1, MAX_POSITIONS, lo_inclusive=True),
    "rope_factor": Range(0, why="the rope scaling factor"),
    "rope_low_freq_factor": Range(0),
    "rope_high_freq_factor": Range(0),
    "rope_beta_fast": Range(0),
    "rope_beta_slow": Range(0),
    "rope_mscale": Range(0, lo_inclusive=True),
    "rope_mscale_all_dim": Range(0, lo_inclusive=True),
    "rope_attention_factor": Range(0, lo_inclusive=True, why="0 means: derived from the factor"),
    "rope_rotary_dim": Range(0, lo_inclusive=True, why="0 means: every dim of a head rotates"),
    "mscale": Range(0),
    "sliding_window": Range(0, lo_inclusive=True, why="0 means: no window"),
    "routed_scaling": Range(0),
}


# list-valued model config parameters: the range of every entry
CONFIG_ITEM_RANGES: dict[str, Range] = {
    "rope_short_factor": Range(0, why="LongRoPE divides each rotary frequency by its factor"),
    "rope_long_factor": Range(0, why="LongRoPE divides each rotary frequency by its factor"),
}


def check_config_values(model: A.ModelDecl, call: A.Call, config: Mapping[str, Any]) -> None:
    """Raises a SourceError at the recipe's value (or at the model's default) for a config value out of range."""
    given = dict(call.kwargs)
    defaults = {p.name: p for p in model.config}
    for name, value in config.items():
        if name in CONFIG_ITEM_RANGES and isinstance(value, tuple):
            _check_items(name, value, CONFIG_ITEM_RANGES[name], given, defaults, call)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        rng = CONFIG_RANGES.get(name)
        finite = not isinstance(value, float) or math.isfinite(value)
        if finite and (rng is None or rng.contains(value)):
            continue
        loc, notes = _where(name, given, defaults, call)
        if not finite:
            raise SourceError(f"'{name}' = {value}: a model config value must be a finite number", loc, notes)
        why = f" ({rng.why})" if rng.why else ""
        raise SourceError(f"'{name}' must be {rng.describe()}, got {fmt_number(value)}{why}", loc, notes)


def _check_items(name: str, items: tuple, rng: Range, given: Mapping[str, A.Expr],
                 defaults: Mapping[str, A.ConfigParam], call: A.Call) -> None:
    for i, v in enumerate(items):
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and rng.contains(v):
            continue
        loc, notes = _where(name, given, defaults, call)
        why = f" ({rng.why})" if rng.why else ""
        raise SourceError(f"'{name}'[{i}] must be a finite number {rng.describe()}, got {v!r}{why}", loc, notes)


def _where(name: str, given: Mapping[str, A.Expr], defaults: Mapping[str, A.ConfigParam],
           call: A.Call) -> tuple[Loc, tuple[str, ...]]:
    if name in given:
        return given[name].loc, ()
    p = defaults[name]
    at = p.default.loc if p.default is not None else p.loc
    return call.loc, (f"the value is the default of '{name}' at {at}; set it in the recipe",)


# recipe section values whose range a model-independent check cannot see in dsl/check.py
SECTION_RANGES: dict[tuple[str, str], Range] = {
    ("serve", "max_model_len"): Range(1, MAX_POSITIONS, lo_inclusive=True, why="positions the rotary tables hold"),
}


def check_section_values(recipe: A.RecipeDecl) -> None:
    for sec in recipe.sections:
        for ent in sec.entries:
            rng = SECTION_RANGES.get((sec.name, getattr(ent, "key", "")))
            if rng is not None and isinstance(ent.value, A.Num) and not rng.contains(ent.value.value):
                raise SourceError(f"'{sec.name}.{ent.key}' must be {rng.describe()}, got {fmt_number(ent.value.value)}"
                                  + (f" ({rng.why})" if rng.why else ""), ent.value.loc)


# ---------------------------------------------------------------- quantization schemes

# fp8(act=...) -> linear_fp8's `act` attribute
FP8_ACT_OPTIONS = {"none": "none", "dynamic": "dynamic_per_token", "static": "static_per_tensor"}
# Where fp8 KV scales come from: the checkpoint's k_scale/v_scale (compressed-tensors / llm-compressor), else a
# calibration run at compile time ("auto"); only the checkpoint ("checkpoint"); only calibration ("calibrate").
KV_SCALE_SOURCES = ("auto", "checkpoint", "calibrate")


@dataclass(frozen=True)
class WeightScheme:
    """A parsed `quantize { weights = ... }`.

    fp8:  `fp8` (per-tensor scale), `fp8(per_channel=true)` (one scale per output row), `fp8(block=128)`
          (one per 128x128 tile, DeepSeek-V3); `act=dynamic` also quantizes activations per token (w8a8);
          `act=static` quantizes them with one calibrated scale per linear input (compressed-tensors
          `input_scale`; computed at compile time for a float checkpoint).
    awq:  `awq(group=128)` — AutoAWQ GEMM checkpoints, loaded as published.
    gptq: `gptq(group=128, sym=true, format=v1)` — AutoGPTQ/GPTQModel checkpoints; format v1 (zeros stored
          minus one: what both libraries write) or v2 (GPTQModel's internal gptq_v2).
    """

    kind: str
    granularity: str = "tensor"
    block: int = 0
    act: str = "none"
    group: int = 128
    zero_offset: int = 1
    sym: bool = True

    def to_attrs(self) -> dict[str, Any]:
        if self.kind == "fp8":
            return {"granularity": self.granularity, "block": self.block, "act": self.act}
        return {"format": self.kind, "group": self.group, "zero_offset": self.zero_offset}


def _scheme_options(value: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        return value, {}
    if isinstance(value, Mapping) and "kind" in value:
        if value.get("args"):
            raise ValueError(f"{value['kind']}(...) takes keyword options only, e.g. {value['kind']}(group=128)")
        return value["kind"], {k: v for k, v in value.items() if k not in ("kind", "args")}
    raise ValueError(f"not a quantization scheme: {value!r}")


def _check_keys(kind: str, opts: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"{kind}(...) has no option '{unknown[0]}' (options: {', '.join(allowed)})")


def _fp8(opts: Mapping[str, Any]) -> WeightScheme:
    _check_keys("fp8", opts, ("per_channel", "block", "act"))
    block, per_channel = opts.get("block"), opts.get("per_channel", False)
    if not isinstance(per_channel, bool):
        raise ValueError("fp8(per_channel=...) must be true or false")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block <= 0):
        raise ValueError(f"fp8(block=...) must be a positive int, got {block!r}")
    if block is not None and per_channel:
        raise ValueError("fp8 takes per_channel=true or block=N, not both")
    act = opts.get("act", "none")
    if act not in FP8_ACT_OPTIONS:
        raise ValueError(f"fp8(act=...) is none (weight-only), dynamic (per-token fp8 activations) or static "
                         f"(one calibrated per-tensor activation scale), got {act!r}")
    if act == "static" and block is not None:
        raise ValueError("fp8(block=N) takes act=dynamic (1x128 activation tiles), not act=static")
    granularity = "block" if block else "channel" if per_channel else "tensor"
    return WeightScheme("fp8", granularity, block or 0, FP8_ACT_OPTIONS[act])


def _group(kind: str, opts: Mapping[str, Any]) -> int:
    group = opts.get("group", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 8:
        raise ValueError(f"{kind}(group=...) must be a positive multiple of 8, got {group!r}")
    return group


def _awq(opts: Mapping[str, Any]) -> WeightScheme:
    _check_keys("awq", opts, ("group", "zero_point"))
    if opts.get("zero_point", True) is not True:
        raise ValueError("awq(zero_point=false) is not supported: AutoAWQ GEMM checkpoints carry zero points")
    return WeightScheme("awq", group=_group("awq", opts), zero_offset=0)


def _gptq(opts: Mapping[str, Any]) -> WeightScheme:
    _check_keys("gptq", opts, ("group", "sym", "format"))
    fmt = opts.get("format", "v1")
    if fmt not in ("v1", "v2"):
        raise ValueError(f"gptq(format=...) is v1 (zeros stored minus one, as AutoGPTQ/GPTQModel save) or v2, "
                         f"got {fmt!r}")
    sym = opts.get("sym", True)
    if not isinstance(sym, bool):
        raise ValueError("gptq(sym=...) must be true or false")
    return WeightScheme("gptq", group=_group("gptq", opts), zero_offset=1 if fmt == "v1" else 0, sym=sym)


WEIGHT_SCHEMES: dict[str, Callable[[Mapping[str, Any]], WeightScheme]] = {"fp8": _fp8, "awq": _awq, "gptq": _gptq}


def parse_weight_scheme(value: Any) -> WeightScheme:
    """The scheme of a recipe's `quantize.weights` value; ValueError says what is wrong with it."""
    kind, opts = _scheme_options(value)
    if kind not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight quantization '{kind}' (known: {', '.join(WEIGHT_SCHEMES)})")
    return WEIGHT_SCHEMES[kind](opts)


def parse_kv_scheme(value: Any) -> str:
    """The scale source of `kv_cache = fp8` / `fp8(scales=auto|checkpoint|calibrate)`; ValueError otherwise."""
    if value == "fp8":
        return "auto"
    if isinstance(value, Mapping) and value.get("kind") == "fp8" and not value.get("args"):
        opts = {k: v for k, v in value.items() if k not in ("kind", "args")}
        if set(opts) - {"scales"}:
            raise ValueError(f"fp8(...) for the KV cache takes only scales=, not '{sorted(set(opts) - {'scales'})[0]}'")
        scales = opts.get("scales", "auto")
        if scales not in KV_SCALE_SOURCES:
            raise ValueError(f"kv_cache fp8(scales=...) is one of {', '.join(KV_SCALE_SOURCES)}, got {scales!r}")
        return scales
    kind = value.get("kind") if isinstance(value, Mapping) else value
    raise ValueError(f"KV cache quantization '{kind}' is not supported (supported: fp8)")


# ---------------------------------------------------------------- value checks of the recipe's syntax
# Each takes (expr, key) and raises a SourceError at expr.loc; a section field names its check in its metadata.


Validator = Callable[[A.Expr, str], None]


def _pos_int(expr: A.Expr, key: str) -> None:
    v = literal(expr, f"'{key}'", "a positive int")
    if not (type_name(v) == "int" and v > 0):
        raise SourceError(f"'{key}' must be a positive int, got {v!r}", expr.loc)


def _power_of_two(expr: A.Expr, key: str) -> None:
    _pos_int(expr, key)
    v = eval_expr(expr, {})
    if v & (v - 1):
        raise SourceError(f"'{key}' must be a power of two, got {v}", expr.loc)


def _fraction(expr: A.Expr, key: str) -> None:
    v = literal(expr, f"'{key}'", "a number in (0, 1]")
    if type_name(v) not in ("int", "float") or not 0 < v <= 1:
        raise SourceError(f"'{key}' must be a number in (0, 1], got {v!r}", expr.loc)


def _port(expr: A.Expr, key: str) -> None:
    v = literal(expr, f"'{key}'", "a port number")
    if type_name(v) != "int" or not 0 < v < 65536:
        raise SourceError(f"'{key}' must be a port number in 1..65535, got {v!r}", expr.loc)


def _string(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, A.Str) or not expr.value:
        raise SourceError(f"'{key}' must be a non-empty string", expr.loc)


def _choice(*choices: str) -> Validator:
    def check(expr: A.Expr, key: str) -> None:
        name = expr.id if isinstance(expr, A.Name) else expr.value if isinstance(expr, A.Str) else None
        if name not in choices:
            shown = name if name is not None else "this"
            raise SourceError(f"'{key}' must be one of {', '.join(choices)}, not '{shown}'"
                              + (did_you_mean(name, choices) if name else ""), expr.loc)
    return check


def _flag(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, A.Bool):
        raise SourceError(f"'{key}' must be true or false", expr.loc)


def _symbol(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, A.Name):
        raise SourceError(f"'{key}' must be a name such as {_SYMBOL_EXAMPLES.get(key, 'fp8 or auto')}", expr.loc)


_SYMBOL_EXAMPLES = {"target": "cpu or h200", "method": "mtp"}


def _scheme(expr: A.Expr, key: str) -> None:
    """`fp8` or `fp8(block=128)`: the scheme names belong to the compiler's quantization registry."""
    if not isinstance(expr, (A.Name, A.Call)):
        raise SourceError(f"'{key}' must be a scheme such as fp8 or fp8(block=128)", expr.loc)
    if isinstance(expr, A.Call):
        for _, v in expr.kwargs:
            if not isinstance(v, A.Name):  # `fp8(block=128)`, `awq(group=128, zero_point=true)`
                eval_expr(v, {})


def _weights(expr: A.Expr, key: str) -> None:
    if isinstance(expr, A.Str) and expr.value:
        return
    if isinstance(expr, A.Call) and expr.func == "random" and not expr.args:
        for i, (k, v) in enumerate(expr.kwargs):
            if k != "seed":
                loc = expr.kwarg_locs[i] if i < len(expr.kwarg_locs) else v.loc
                raise SourceError(f"random(...) takes only seed=, not '{k}'", loc)
            if type_name(literal(v, "'seed'", "int")) != "int":
                raise SourceError("'seed' must be an int", v.loc)
        return
    raise SourceError('\'weights\' must be a checkpoint such as "hf:./path" or random(seed=0)', expr.loc)


def _hf_dir(expr: A.Expr, key: str) -> None:
    if not (isinstance(expr, A.Str) and expr.value.startswith("hf:") and len(expr.value) > 3):
        raise SourceError(f"'{key}' must be a Hugging Face directory such as \"hf:./path\"", expr.loc)


def _offload(expr: A.Expr, key: str) -> None:
    if isinstance(expr, A.Name) and expr.id == "none":
        return
    if (isinstance(expr, A.Call) and expr.func == "cpu" and len(expr.args) == 1 and not expr.kwargs
            and isinstance(expr.args[0], A.Size) and expr.args[0].value > 0):
        return
    raise SourceError("'offload' must be cpu(SIZE), e.g. cpu(16GiB), or none", expr.loc)


def _chunked_prefill(expr: A.Expr, key: str) -> None:
    if isinstance(expr, A.Bool):
        return
    _pos_int(expr, key)


def _batch_sizes(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, A.List) or not expr.items:
        raise SourceError(f"'{key}' must be a list of positive ints, e.g. [1, 2, 4, 8]", expr.loc)
    for item in expr.items:
        _pos_int(item, key)


def _draft(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, (A.Str, A.Call)):
        raise SourceError("'draft' must be a checkpoint string or a model instantiation", expr.loc)


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _adapters(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, A.Map):
        raise SourceError('\'adapters\' must be a map of names to PEFT directories, e.g. { sql: "hf:./sql-lora" }',
                          expr.loc)
    for (name, value), loc in zip(expr.items, expr.key_locs or [expr.loc] * len(expr.items), strict=True):
        if not ADAPTER_NAME.fullmatch(name):
            raise SourceError(f"adapter name '{name}' must be letters, digits, '.', '_' or '-' (it is the "
                              "OpenAI `model` a request names)", loc)
        _hf_dir(value, f"adapters.{name}")


EFFORT_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _effort_budgets(expr: A.Expr, key: str) -> None:
    example = "{ low: 512, medium: 2048, high: 8192 }"
    if not isinstance(expr, A.Map):
        raise SourceError(f"'{key}' must be a map of reasoning efforts to thinking budgets in tokens, e.g. {example}",
                          expr.loc)
    for (name, value), loc in zip(expr.items, expr.key_locs or [expr.loc] * len(expr.items), strict=True):
        if not EFFORT_NAME.fullmatch(name):
            raise SourceError(f"reasoning effort '{name}' must be a lower-case word such as low or high", loc)
        v = literal(value, f"'{key}.{name}'", "a thinking budget in tokens (an int >= 0)")
        if not (type_name(v) == "int" and v >= 0):
            raise SourceError(f"'{key}.{name}' must be a thinking budget in tokens (an int >= 0), got {v!r}",
                              value.loc)


def _size(expr: A.Expr, key: str) -> None:
    if not (isinstance(expr, A.Size) and expr.value > 0):
        raise SourceError(f"'{key}' must be a byte size such as 4GiB", expr.loc)


def _disable(expr: A.Expr, key: str) -> None:
    if not isinstance(expr, A.List) or not all(isinstance(i, (A.Name, A.Str)) for i in expr.items):
        raise SourceError("'disable' must be a list of pass names, e.g. [fuse_qkv]", expr.loc)


def opt(default: Any = None, check: Validator | None = None, **kw: Any) -> Any:
    """A recipe option: its default and the check of the value a recipe writes (None: not a recipe key)."""
    return field(default=default, metadata={"check": check}, **kw)


# ---------------------------------------------------------------- the sections

GiB = 2**30


@dataclass(frozen=True)
class KVCacheOptions:
    block_size: int = opt(16, _power_of_two)
    memory_fraction: float = opt(0.9, _fraction)  # of the device's memory, on targets that size the pool at load
    num_blocks: int | None = opt(None, _pos_int)  # a fixed pool, whatever the memory
    offload: int | None = opt(None, _offload)  # bytes of host memory for evicted prefix blocks (cpu(16GiB))


@dataclass(frozen=True)
class SchedulerOptions:
    max_seqs: int = opt(256, _pos_int)
    # tokens a step computes, decodes and prefill chunks together; None (only in a SchedulerOptions built by hand):
    # the target's (compiler/targets.py Target.max_batched_tokens), which recipe_options and from_meta fill in
    max_batched_tokens: int | None = opt(None, _pos_int)
    chunked_prefill: int | None = opt(512, _chunked_prefill)  # prompt tokens of a sequence per step; None: no limit
    policy: str = opt("fcfs", _choice("fcfs", "priority", "effort"))
    prefix_cache: str = opt("radix", _choice("radix", "none"))
    preemption: str = opt("recompute", _choice("recompute", "swap"))
    swap_space: int = opt(4 * GiB, _size)  # bytes of CPU memory for swapped-out KV blocks
    async_scheduling: bool | None = opt(None, _flag)  # None: on for CUDA devices, off for CPU
    # admitted only with KV for their whole budget, never preempted: those with a thinking budget, all, none
    kv_reserve: str = opt("reasoning", _choice("reasoning", "all", "none"))


@dataclass(frozen=True)
class QuantizeOptions:
    weights: WeightScheme | None = opt(None, _scheme)
    kv_cache: str | None = opt(None, _scheme)  # the fp8 KV scale source (KV_SCALE_SOURCES)
    spelling: Mapping[str, Any] = field(default_factory=dict)  # the recipe's values, as written


@dataclass(frozen=True)
class ParallelOptions:
    """The device mesh (compiler/placement.py `Mesh`): tp x dp ranks; experts in ep groups of whole experts."""

    tp: int = opt(1, _pos_int)
    dp: int = opt(1, _pos_int)  # data-parallel attention (each rank its own sequences); MLPs sharded over tp x dp
    ep: int = opt(1, _pos_int)
    pp: int = opt(1, _pos_int)  # pipeline parallelism: not built (compiler/support.py refuses pp > 1)
    expert_placement: str = opt("contiguous", _choice("contiguous", "round_robin"))  # experts -> ep groups
    # dense MLPs (shared experts included) under data-parallel attention: sharded over every rank (their rows
    # gathered and reduce-scattered), or replicated so each rank computes its own rows (SGLang's dense-TP 1)
    dense: str = opt("sharded", _choice("sharded", "replicated"))

    @property
    def world(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class SpeculativeOptions:
    method: str | None = opt(None, _symbol)  # a draft head of the model (mtp), ngram, draft or eagle (`draft` below)
    tokens: int = opt(1, _pos_int)
    draft: Any = opt(None, _draft)  # method = draft / eagle: the draft model's / EAGLE head's checkpoint, "hf:DIR" (kiln/driver.py)


@dataclass(frozen=True)
class LoraOptions:
    """Multi-LoRA serving: `max_loras` adapter slots on the device (adapters beyond them are paged in by LRU),
    `max_rank` the largest rank a slot holds, `adapters` name -> "hf:DIR" (a PEFT checkpoint) compiled in."""

    max_loras: int = opt(4, _pos_int)
    max_rank: int = opt(16, _pos_int)
    adapters: Mapping[str, str] = field(default_factory=dict, metadata={"check": _adapters})


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CudaGraphsOptions:
    batch_sizes: tuple[int, ...] | None = opt(None, _batch_sizes)  # None: DEFAULT_BATCH_SIZES up to max_seqs

    def buckets(self, max_seqs: int) -> tuple[int, ...]:
        """The capture buckets, ascending; ValueError when one is not a positive int, is repeated, or exceeds
        `max_seqs` (its graph could never be filled)."""
        if self.batch_sizes is None:
            return tuple(b for b in DEFAULT_BATCH_SIZES if b <= max_seqs)
        if not self.batch_sizes:
            raise ValueError("batch_sizes must be a non-empty list of positive ints, e.g. [1, 2, 4, 8]")
        seen: set[int] = set()
        for b in self.batch_sizes:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"batch size {b!r} is not a positive int")
            if b in seen:
                raise ValueError(f"batch size {b} is listed twice")
            if b > max_seqs:
                raise ValueError(f"batch size {b} exceeds scheduler.max_seqs = {max_seqs}: a decode batch never "
                                 "holds that many sequences (raise max_seqs or drop the bucket)")
            seen.add(b)
        return tuple(sorted(seen))


@dataclass(frozen=True)
class DisaggregateOptions:
    """Prefill/decode disaggregation on one machine (`kiln serve ART --disaggregate`; runtime/disagg)."""
    prefill: int = opt(1, _pos_int)  # prefill cores
    decode: int = opt(1, _pos_int)  # decode cores
    transport: str = opt("auto", _choice("auto", "tcp", "nixl"))  # auto: tcp (no extra dependency)
    # auto: remotely only what would stall the decode core (runtime/disagg/service.py); always: tests, benchmarks
    remote_prefill: str = opt("auto", _choice("always", "never", "auto"))


@dataclass(frozen=True)
class ServeOptions:
    host: str = opt("127.0.0.1", _string)  # loopback only
    port: int = opt(8000, _port)
    served_name: str | None = opt(None, _string)  # None: the artifact directory's name
    max_model_len: int | None = opt(None, _pos_int)  # None: the model's max_position, else the checkpoint's, else 4096
    # reasoning_effort -> thinking budget (tokens), over the runtime's defaults (runtime/thinking.py)
    reasoning_effort: Mapping[str, int] = field(default_factory=dict, metadata={"check": _effort_budgets})


@dataclass(frozen=True)
class PassesOptions:
    disable: tuple[str, ...] = opt((), _disable)
    hooks: tuple[Mapping[str, str], ...] = ()  # {"position", "anchor", "spec"}


SECTIONS: dict[str, type] = {
    "kv_cache": KVCacheOptions, "scheduler": SchedulerOptions, "quantize": QuantizeOptions,
    "parallel": ParallelOptions, "speculative": SpeculativeOptions, "lora": LoraOptions,
    "cuda_graphs": CudaGraphsOptions, "disaggregate": DisaggregateOptions, "serve": ServeOptions,
    "passes": PassesOptions,
}


@dataclass(frozen=True)
class RecipeOptions:
    """Every recipe option with its value: the recipe's, else the default above. `locs` maps "target",
    "quantize.weights", "lora" (a section) ... to where the recipe wrote it, for errors about it."""

    target: str = opt("cpu", _symbol)  # the registry (compiler/targets.py) knows the names
    dtype: str = opt("fp32", _choice("fp32", "bf16", "fp16"))
    # generate: an LLM (logits, sampling); embed: a pooling model (passes/embed_output.py, docs/embeddings.md)
    task: str = opt("generate", _choice("generate", "embed"))
    random_weights: bool = False  # weights = random(seed=N)
    kv_cache: KVCacheOptions = field(default_factory=KVCacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    cuda_graphs: CudaGraphsOptions = field(default_factory=CudaGraphsOptions)
    disaggregate: DisaggregateOptions = field(default_factory=DisaggregateOptions)
    serve: ServeOptions = field(default_factory=ServeOptions)
    passes: PassesOptions = field(default_factory=PassesOptions)
    set_sections: frozenset[str] = frozenset()  # sections the recipe wrote entries in
    locs: Mapping[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    def loc(self, key: str, default: Loc | None = None) -> Loc | None:
        return self.locs.get(key, default)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any] | None) -> RecipeOptions:
        """The options of a program's `meta` (what the driver put there: `to_meta()`; a hand-made partial
        mapping in tests gets the defaults for the rest). ValueError for a value that does not parse."""
        if isinstance(meta, RecipeOptions):
            return meta
        return _from_values(dict(meta or {}), {})

    def to_meta(self) -> dict[str, Any]:
        """The options as the plain mapping a Program carries (`program.meta`) and passes read."""
        return {"target": self.target, "dtype": self.dtype, "options": self}

    def section(self, name: str) -> Any:
        return getattr(self, name)


def section_values(recipe: A.RecipeDecl) -> dict[str, Any]:
    """A recipe's top-level settings and sections as plain values (names → str, calls → dicts)."""

    def value(e: A.Expr) -> Any:
        if isinstance(e, A.Num | A.Str | A.Bool | A.Size):
            return e.value
        if isinstance(e, A.Name):
            return e.id
        if isinstance(e, A.List):
            return [value(x) for x in e.items]
        if isinstance(e, A.Map):
            return {k: value(v) for k, v in e.items}
        if isinstance(e, A.Call):
            return {"kind": e.func, "args": [value(a) for a in e.args], **{k: value(v) for k, v in e.kwargs}}
        if isinstance(e, A.UnaryOp) and e.op == "-":
            return -value(e.operand)
        return eval_expr(e, {})

    out: dict[str, Any] = {s.key: value(s.value) for s in recipe.settings}
    for sec in recipe.sections:
        entries: dict[str, Any] = {}
        for ent in sec.entries:
            if isinstance(ent, A.PassHook):
                entries.setdefault("hooks", []).append({"position": ent.position, "anchor": ent.anchor,
                                                        "spec": ent.spec.value})
            else:
                entries[ent.key] = value(ent.value)
        out[sec.name] = entries
    return out


# top-level recipe settings that are not RecipeOptions fields: the model (dsl/check.py checks its call) and
# where the weights and tokenizer come from (the driver resolves them)
_SETTINGS: dict[str, Validator | None] = {"model": None, "weights": _weights, "tokenizer": _hf_dir}


def _checks(cls: type) -> dict[str, Validator]:
    """A section's recipe keys and their checks: its fields that declare one."""
    return {f.name: f.metadata["check"] for f in dataclasses.fields(cls) if f.metadata.get("check")}


def check_recipe_syntax(recipe: A.RecipeDecl) -> None:
    """Every setting and section entry is a known key with a value of its form, each error at its place
    (unknown names get a did-you-mean). The keys are the option dataclasses' fields: one list."""
    top = {**_SETTINGS, **_checks(RecipeOptions)}
    for s in recipe.settings:
        if s.key not in top:
            note = f"recipe settings are {', '.join(top)}; sections are {', '.join(SECTIONS)}"
            raise SourceError(f"unknown recipe setting '{s.key}'" + did_you_mean(s.key, top), key_loc(s), (note,))
        if top[s.key] is not None:
            top[s.key](s.value, s.key)
    sections: dict[str, A.Section] = {}
    for sec in recipe.sections:
        if sec.name in sections:
            raise SourceError(f"section '{sec.name}' appears twice", sec.loc, (f"first at {sections[sec.name].loc}",))
        if sec.name not in SECTIONS:
            raise SourceError(f"unknown section '{sec.name}'" + did_you_mean(sec.name, SECTIONS), sec.loc,
                              (f"sections are {', '.join(SECTIONS)}",))
        sections[sec.name] = sec
        _check_section(sec, _checks(SECTIONS[sec.name]))


def _check_section(sec: A.Section, keys: Mapping[str, Validator]) -> None:
    seen: dict[str, A.Setting] = {}
    for entry in sec.entries:
        if isinstance(entry, A.PassHook):
            if sec.name != "passes":
                raise SourceError(f"'{entry.position} {entry.anchor}: ...' belongs in the passes section", entry.loc)
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", entry.spec.value):
                raise SourceError(f"a pass is named \"package.module:Class\", got \"{entry.spec.value}\"",
                                  entry.spec.loc)
            continue
        if entry.key not in keys:
            raise SourceError(f"unknown key '{entry.key}' in section '{sec.name}'" + did_you_mean(entry.key, keys),
                              key_loc(entry), (f"'{sec.name}' takes {', '.join(keys)}",))
        if entry.key in seen:
            raise SourceError(f"'{entry.key}' is set twice in section '{sec.name}'", key_loc(entry),
                              (f"first set at {seen[entry.key].loc}",))
        seen[entry.key] = entry
        keys[entry.key](entry.value, entry.key)


def recipe_options(recipe: A.RecipeDecl, *, target: str | None = None) -> RecipeOptions:
    """The recipe's options, checked (check_recipe_syntax) and filled in once; a value that does not parse is a
    SourceError at it. `target` overrides the recipe's (the --target flag)."""
    check_recipe_syntax(recipe)
    check_section_values(recipe)
    values = section_values(recipe)
    if target is not None:
        values["target"] = target
    locs: dict[str, Loc] = {s.key: s.value.loc for s in recipe.settings}
    for sec in recipe.sections:
        locs[sec.name] = sec.entries[0].loc if sec.entries else sec.loc
        for ent in sec.entries:
            if isinstance(ent, A.Setting):
                locs[f"{sec.name}.{ent.key}"] = ent.value.loc
    if target is not None:
        locs.pop("target", None)
    return _from_values(values, locs)


def _from_values(values: dict[str, Any], locs: Mapping[str, Loc]) -> RecipeOptions:
    if isinstance(values.get("options"), RecipeOptions):  # a Program's meta: the driver's options
        return values["options"]
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        raw = dict(values.get(name) or {})
        try:
            sections[name] = _SECTION_PARSERS.get(name, _plain)(cls, raw)
        except ValueError as e:
            key = next((k for k in raw if f"{name}.{k}" in locs and str(k) in str(e)), None)
            where = locs.get(f"{name}.{key}") if key else locs.get(name)
            raise SourceError(f"{name}{'.' + key if key else ''}: {e}", where) from None
    target = str(values.get("target", "cpu"))
    sections["scheduler"] = _target_defaults(sections["scheduler"], target)
    written = frozenset(n for n in SECTIONS if values.get(n))
    weights = values.get("weights")
    return RecipeOptions(target=target, dtype=str(values.get("dtype", "fp32")), task=str(values.get("task", "generate")),
                         random_weights=isinstance(weights, Mapping) and weights.get("kind") == "random",
                         **sections, set_sections=written, locs=dict(locs))


def _target_defaults(sched: SchedulerOptions, target: str) -> SchedulerOptions:
    """The scheduler options with what the recipe left to its target filled in: the step budget. A target the
    registry does not know leaves it None (the driver refuses the target before anything reads it)."""
    tgt = TARGETS.get(target)
    if sched.max_batched_tokens is not None or tgt is None:
        return sched
    return dataclasses.replace(sched, max_batched_tokens=tgt.max_batched_tokens)


def _plain(cls: type, raw: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"no option {unknown[0]!r} (options: {', '.join(sorted(names))})")
    return cls(**raw)


def _scheduler(cls: type, raw: Mapping[str, Any]) -> SchedulerOptions:
    raw = dict(raw)
    chunk = raw.get("chunked_prefill")
    if chunk is True:  # `chunked_prefill = true`: the default chunk
        raw["chunked_prefill"] = SchedulerOptions.chunked_prefill
    elif chunk is False:
        raw["chunked_prefill"] = None
    if "async_scheduling" in raw and raw["async_scheduling"] in ("true", "false"):
        raw["async_scheduling"] = raw["async_scheduling"] == "true"
    return _plain(cls, raw)


def _quantize(cls: type, raw: Mapping[str, Any]) -> QuantizeOptions:
    unknown = sorted(set(raw) - {"weights", "kv_cache"})
    if unknown:
        raise ValueError(f"no option {unknown[0]!r} (options: kv_cache, weights)")
    weights = parse_weight_scheme(raw["weights"]) if raw.get("weights") is not None else None
    kv = parse_kv_scheme(raw["kv_cache"]) if raw.get("kv_cache") is not None else None
    return QuantizeOptions(weights, kv, dict(raw))


def _cuda_graphs(cls: type, raw: Mapping[str, Any]) -> CudaGraphsOptions:
    sizes = raw.get("batch_sizes")
    return _plain(cls, {**raw, **({"batch_sizes": tuple(sizes)} if sizes is not None else {})})


def _kv_cache(cls: type, raw: Mapping[str, Any]) -> KVCacheOptions:
    offload = raw.get("offload")
    if isinstance(offload, Mapping):  # cpu(16GiB)
        offload = offload["args"][0]
    elif offload == "none":
        offload = None
    return _plain(cls, {**raw, **({"offload": offload} if "offload" in raw else {})})


def _passes(cls: type, raw: Mapping[str, Any]) -> PassesOptions:
    return PassesOptions(tuple(raw.get("disable", ())), tuple(raw.get("hooks", ())))


_SECTION_PARSERS: dict[str, Callable[[type, Mapping[str, Any]], Any]] = {
    "scheduler": _scheduler, "quantize": _quantize, "cuda_graphs": _cuda_graphs, "kv_cache": _kv_cache,
    "passes": _passes,
}
