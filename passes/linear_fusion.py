"""Shared by fuse_qkv and fuse_gate_up: the guard and the replacement that merge sibling linears into one
(fuse_expert_gate_up reuses the param guard, `concatenable`).

Sibling linears read the same input; each weight (and bias, if any) is a `param`. The merged linear reads a
new param whose `source` is the siblings' sources in role order, concatenated along dim 0, so the weight
converter builds the fused tensor from the checkpoint exactly as the separate ones were built; each old
linear's value becomes a `slice` of the merged output.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kiln.compiler import ParamSpec
from kiln.passes.rewrite import Builder, Match


def fusible_linears(m: Match, roles: Sequence[str], bias: bool) -> bool:
    """Guard: distinct linears over plain, same-dtype, unquantized, unsharded params of one block."""
    if len({m[r] for r in roles}) != len(roles):
        return False
    groups = [[m.param(f"w{r}") for r in roles]] + ([[m.param(f"b{r}") for r in roles]] if bias else [])
    return all(concatenable(specs) for specs in groups)


def concatenable(specs: Sequence[ParamSpec]) -> bool:
    """Same dtype and block, unquantized, unsharded, equal trailing dims, all from the checkpoint or none."""
    first = specs[0]
    for s in specs:
        if s.dtype != first.dtype or s.block != first.block or s.quant is not None or s.sharding is not None:
            return False  # quantized/sharded weights carry per-tensor state a plain concat would break
        if len(s.source) > 1 and s.concat_dim != 0:
            return False
        if s.shape[1:] != first.shape[1:]:
            return False
    return len({bool(s.source) for s in specs}) == 1  # all from the checkpoint, or all generated


def concat_params(specs: Sequence[ParamSpec], local_name: str) -> ParamSpec:
    """The ParamSpec of `specs` concatenated along dim 0, named `{block}.{local_name}`."""
    first = specs[0]
    name = f"{first.block}.{local_name}" if first.block else local_name
    rows = sum(s.shape[0] for s in specs)
    return dataclasses.replace(first, name=name, shape=(rows, *first.shape[1:]),
                               source=tuple(src for s in specs for src in s.source), concat_dim=0)


def fuse_linears(m: Match, b: Builder, roles: Sequence[str], bias: bool, fused: str) -> dict[str, str]:
    """linear(x, w_r[, b_r]) for each role r -> y = linear(x, w_fused[, b_fused]); r -> slice(y, ...).

    `fused` names the merged value and params: w{fused} / b{fused} (e.g. "qkv" -> decoder.wqkv)."""
    weights = [m.param(f"w{r}") for r in roles]
    inputs = [m["x"], b.add_param(concat_params(weights, f"w{fused}"), after=weights[0].name)]
    if bias:
        biases = [m.param(f"b{r}") for r in roles]
        inputs.append(b.add_param(concat_params(biases, f"b{fused}"), after=biases[0].name))
    y = b.add("linear", inputs, hint=fused)
    out: dict[str, str] = {}
    start = 0
    for r, w in zip(roles, weights, strict=True):
        stop = start + w.shape[0]
        out[r] = b.add("slice", (y,), hint=m[r], start=start, stop=stop)
        start = stop
    return out
