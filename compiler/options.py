"""Recipe values and their ranges, checked once with the location of the value that is wrong.

A value that type-checks can still compile to an artifact that cannot run: `rope_theta = 0` (an infinite
rotary frequency), `norm_eps = -1` (a NaN norm), `max_position = 1000000000` (a rotary table of tens of GB
allocated at load). Every model config value a bundled model names is range-checked here; every float must
be finite whatever its name.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.dsl import ast as A
from kiln.dsl.errors import Loc, SourceError

# Defaults of the recipe's sections, where a recipe does not set them (one place: codegen, the passes and the
# report read them from here; the manifest then carries the values, so the runtime needs none of its own)
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MEMORY_FRACTION = 0.9
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_SCHEDULER = {"max_seqs": 256, "max_batched_tokens": 8192, "chunked_prefill": 512, "policy": "fcfs",
                     "prefix_cache": "radix"}

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
    "mscale": Range(0),
    "sliding_window": Range(0, lo_inclusive=True, why="0 means: no window"),
    "routed_scaling": Range(0),
}


def check_config_values(model: A.ModelDecl, call: A.Call, config: Mapping[str, Any]) -> None:
    """Raises a SourceError at the recipe's value (or at the model's default) for a config value out of range."""
    given = dict(call.kwargs)
    defaults = {p.name: p for p in model.config}
    for name, value in config.items():
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
