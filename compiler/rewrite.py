"""Rewrites as data: structural patterns, replacement functions, and the driver that applies a table (the
compiler's infrastructure, used by the fusion and quantization passes).

A fusion pass is a table of `Rewrite`s, each with a `# before -> after` comment:

    REWRITES = (
        # mul(silu(slice(y, 0, F)), slice(y, F, 2F)) -> silu_mul(y)
        Rewrite("silu_mul", P("mul", P("silu", P("slice", V("y"), name="gate")), P("slice", V("y"), name="up"),
                              commutative=True),
                replace=_silu_mul, extra_check=_halves_of_y),
    )

    def run(self, program, ctx):
        return apply_rewrites(program, REWRITES, ctx)

`P(op, *inputs)` matches a node by op and inputs; `V(name)` matches any value. A name binds the value id it
matched; a name used twice must bind the same value (that is how "reads the same input" is said). The pattern
is purely structural; `extra_check(match)` is the semantic guard (sizes, dtypes, use counts). The driver indexes
a table's rules by the op their pattern's root can be (`root_ops`), so a node is tried only against the rules
that can match it, in table order. `replace(match,
builder)` adds the new nodes and returns the value replacing the root, or `{bound name: new value}` for
rewrites that replace inner values (fusing the q/k/v linears under an attention). Every use of a replaced
value is redirected; matched nodes left without users are removed; new nodes are typed by the op table.
"""
from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from kiln.compiler.ir import Attrs, Graph, Node, ParamSpec, Program, TensorType
from kiln.compiler.ops import OPS
from kiln.compiler.pass_manager import PassContext


@dataclass(frozen=True)
class Pat:
    """A structural pattern rooted at one value.

    `op` None matches any value (a variable); `inputs` None accepts any inputs. `through` lets the match
    first walk back through zero or more nodes of these ops along their first input (e.g. the view/rope
    between a q projection and its attention). `commutative` also tries two inputs in swapped order.
    """

    op: str | tuple[str, ...] | None = None
    inputs: tuple[Pat, ...] | None = None
    name: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)  # exact values the node's attributes must have
    commutative: bool = False
    through: tuple[str, ...] = ()


def P(op: str | tuple[str, ...], *inputs: Pat, name: str | None = None, commutative: bool = False,
      through: Sequence[str] = (), **attrs: Any) -> Pat:
    """A node of op `op` (or one of several) whose inputs match `inputs` exactly (none given: any inputs)."""
    return Pat(op, tuple(inputs) if inputs or op in ("param", "input") else None, name, attrs, commutative,
               tuple(through))


def V(name: str) -> Pat:
    """Any value, bound to `name`."""
    return Pat(name=name)


@dataclass(frozen=True)
class Match:
    """One place a pattern matched: `m["x"]` is the value id bound to x, `m.nodes` every node the pattern
    (not a variable) matched."""

    graph: Graph
    program: Program
    root: str
    bindings: Mapping[str, str]
    nodes: tuple[str, ...]
    params: Mapping[str, ParamSpec]  # the program's, and those earlier rewrites of this pass declared

    def __getitem__(self, name: str) -> str:
        return self.bindings[name]

    def node(self, name: str) -> Node:
        return self.graph.node(self.bindings[name])

    def param(self, name: str) -> ParamSpec:
        """The ParamSpec read by the `param` node bound to `name`."""
        return self.params[self.node(name).attrs["name"]]

    def users(self, name: str) -> list[str]:
        return self.graph.users(self.bindings[name])

    def is_output(self, name: str) -> bool:
        return self.bindings[name] in self.graph.outputs


Replacement = str | Mapping[str, str] | None


@dataclass(frozen=True)
class Rewrite:
    """A local rewrite: pattern, replacement, and an optional semantic guard. `name` keys the match counts."""

    name: str
    pattern: Pat
    replace: Callable[[Match, Builder], Replacement]
    extra_check: Callable[[Match], bool] | None = None


def root_ops(pattern: Pat) -> frozenset[str] | None:
    """The ops a node must have for `pattern` to match rooted at it (its op, or one it walks `through`);
    None when any node can (a variable at the root)."""
    if pattern.op is None:
        return None
    ops = {pattern.op} if isinstance(pattern.op, str) else set(pattern.op)
    return frozenset(ops | set(pattern.through))


class RuleIndex:
    """A table's rules by root op: `for_op(op)` lists, in table order, the rules that can match a node of `op`."""

    def __init__(self, rewrites: Sequence[Rewrite]):
        self.rewrites = tuple(rewrites)
        self._roots = [root_ops(rw.pattern) for rw in self.rewrites]
        self._by_op: dict[str, tuple[Rewrite, ...]] = {}

    def for_op(self, op: str) -> tuple[Rewrite, ...]:
        rules = self._by_op.get(op)
        if rules is None:
            rules = self._by_op[op] = tuple(rw for rw, ops in zip(self.rewrites, self._roots, strict=True)
                                            if ops is None or op in ops)
        return rules


# ---------------------------------------------------------------- matching


def match(pattern: Pat, graph: Graph, program: Program, vid: str,
          params: Mapping[str, ParamSpec] | None = None) -> Match | None:
    """The first match of `pattern` rooted at `vid`, or None."""
    for env, nodes in _match(pattern, graph, vid, {}, ()):
        return Match(graph, program, vid, env, nodes, program.params if params is None else params)
    return None


Env = dict[str, str]


def _match(p: Pat, g: Graph, vid: str, env: Env, nodes: tuple[str, ...]) -> Iterator[tuple[Env, tuple[str, ...]]]:
    yield from _match_here(p, g, vid, env, nodes)
    if p.through and g.node(vid).op in p.through and g.node(vid).inputs:
        yield from _match(p, g, g.node(vid).inputs[0], env, (*nodes, vid))


def _match_here(p: Pat, g: Graph, vid: str, env: Env, nodes: tuple[str, ...]):
    if p.name is not None and p.name in env:
        if env[p.name] == vid:
            yield env, nodes
        return
    node = g.node(vid)
    if p.op is not None:
        if node.op != p.op and not (isinstance(p.op, tuple) and node.op in p.op):
            return
        if any(node.attrs.get(k) != v for k, v in p.attrs.items()):
            return
        nodes = (*nodes, vid)
    if p.name is not None:
        env = {**env, p.name: vid}
    if p.inputs is None:
        yield env, nodes
        return
    if len(p.inputs) != len(node.inputs):
        return
    orders = [p.inputs, p.inputs[::-1]] if p.commutative and len(p.inputs) == 2 else [p.inputs]
    for pins in orders:
        yield from _match_all(pins, node.inputs, g, env, nodes)


def _match_all(pats: Sequence[Pat], vids: Sequence[str], g: Graph, env: Env, nodes: tuple[str, ...]):
    if not pats:
        yield env, nodes
        return
    for env1, nodes1 in _match(pats[0], g, vids[0], env, nodes):
        yield from _match_all(pats[1:], vids[1:], g, env1, nodes1)


# ---------------------------------------------------------------- building replacements


class Builder:
    """What a replacement function may do: add typed nodes and new params to the graph being rewritten."""

    def __init__(self, graph: Graph, program: Program, new_params: dict[str, tuple[ParamSpec, str | None]],
                 loc: Any = None):
        self.graph = graph
        self.program = program
        self._new_params = new_params
        self._loc = loc
        self.added: dict[str, str] = {}  # new value id -> the id it asked for (taken back once free)
        self.declared: list[str] = []  # names of the params it declared

    def add(self, op: str, inputs: Sequence[str], hint: str | None = None, **attrs: Any) -> str:
        """Adds `op(inputs) {attrs}`, typed by the op's shape rule when its inputs are typed.

        `hint` is the value id wanted; if taken (say, by the node being replaced) a suffixed one is used, and
        the driver renames it back to `hint` once the old node is gone."""
        a = Attrs(attrs)
        in_types = [self.graph.node(i).out for i in inputs]
        out = OPS[op].infer(in_types, a) if all(t is not None for t in in_types) else None
        return self._add(hint or op, Node(op, tuple(inputs), a, out, self._loc))

    def _add(self, hint: str, node: Node) -> str:
        vid = self.graph.add(self.graph.fresh(hint), node)
        self.added[vid] = hint
        return vid

    def add_param(self, spec: ParamSpec, hint: str | None = None, after: str | None = None) -> str:
        """Declares `spec` in the program (renamed if its name is taken) and adds a `param` node reading it.

        The new param is listed where `after` (an existing param name) was, to keep the table readable."""
        taken = set(self.program.params) | set(self._new_params)
        name, n = spec.name, 1
        while name in taken:
            name, n = f"{spec.name}_{n}", n + 1
        spec = dataclasses.replace(spec, name=name)
        self._new_params[name] = (spec, after)
        self.declared.append(name)
        t = TensorType(spec.shape, spec.dtype)
        return self._add(hint or spec.local_name, Node("param", (), Attrs({"name": name, "type": t}), t, self._loc))


# ---------------------------------------------------------------- the driver


def params_read(graphs: Mapping[str, Graph]) -> set[str]:
    return {n.attrs["name"] for g in graphs.values() for _, n in g.items() if n.op == "param"}


def apply_rewrites(program: Program, rewrites: Sequence[Rewrite], ctx: PassContext,
                   max_sweeps: int = 100) -> Program:
    """Applies `rewrites` to every graph until none matches; returns a new Program, or `program` itself when
    nothing matched. Counts go to `ctx.stats["matches"]` (total) and `ctx.stats["by_rewrite"]`.

    Params that a graph read before and no graph reads after are dropped; params the replacements declared
    are added. The input program is never mutated (graphs are copied before the first change).
    """
    counts = {r.name: 0 for r in rewrites}
    new_params: dict[str, tuple[ParamSpec, str | None]] = {}
    new_graphs: dict[str, Graph] = {}
    index = RuleIndex(rewrites)
    for gname, original in program.graphs.items():
        g = _rewrite_graph(original, program, index, counts, new_params, max_sweeps)
        if g is not None:
            new_graphs[gname] = g
    total = sum(counts.values())
    ctx.stats["matches"] = ctx.stats.get("matches", 0) + total
    if total:
        ctx.stats["by_rewrite"] = {k: v for k, v in counts.items() if v}
    if not new_graphs:
        return program
    out = program.with_graphs(new_graphs)
    dropped = params_read(program.graphs) - params_read(out.graphs)
    return out.with_params(_merge_params(program.params, new_params, dropped))


def _merge_params(old: Mapping[str, ParamSpec], new: Mapping[str, tuple[ParamSpec, str | None]],
                  dropped: set[str]) -> dict[str, ParamSpec]:
    placed = {}
    for spec, after in new.values():
        placed.setdefault(after if after in old else None, []).append(spec)
    merged: dict[str, ParamSpec] = {}
    for name, spec in old.items():
        for fused in placed.get(name, ()):
            merged[fused.name] = fused
        if name not in dropped:
            merged[name] = spec
    for fused in placed.get(None, ()):
        merged[fused.name] = fused
    return merged


def _rewrite_graph(original: Graph, program: Program, index: RuleIndex, counts: dict[str, int],
                   new_params: dict, max_sweeps: int) -> Graph | None:
    g: Graph | None = None  # copied on the first match
    sort_key: dict[str, tuple[int, ...]] = {vid: (k,) for k, vid in enumerate(original.order())}
    wanted: dict[str, str] = {}  # new value id -> preferred id
    applied = False
    for _ in range(max_sweeps):
        fired = False
        for vid in (g or original).order():
            current = g or original
            if vid not in current:
                continue
            params = ChainMap({name: spec for name, (spec, _) in new_params.items()}, program.params)
            for rw in index.for_op(current.node(vid).op):
                m = match(rw.pattern, current, program, vid, params)
                if m is None or (rw.extra_check is not None and not rw.extra_check(m)):
                    continue
                if g is None:
                    g = original.copy()
                    m = dataclasses.replace(m, graph=g)
                if _apply(rw, m, g, program, new_params, sort_key, wanted):
                    counts[rw.name] += 1
                    fired = applied = True
                    break
        if not fired:
            return _in_source_order(g, sort_key, wanted) if applied else None
    raise AssertionError(f"rewrites on graph {original.name!r} did not reach a fixed point in {max_sweeps} sweeps")


def _apply(rw: Rewrite, m: Match, g: Graph, program: Program, new_params: dict,
           sort_key: dict[str, tuple[int, ...]], wanted: dict[str, str]) -> bool:
    b = Builder(g, program, new_params, loc=g.node(m.root).loc)
    result = rw.replace(m, b)
    if result is None:  # the replacement declined: undo what it built
        for vid in reversed(b.added):
            g.remove(vid)
        for name in b.declared:
            del new_params[name]
        return False
    mapping = {m.root: result} if isinstance(result, str) else {m[k]: v for k, v in result.items()}
    anchor = min(sort_key[old] for old in mapping)
    for k, vid in enumerate(b.added, start=1):
        sort_key[vid] = (*anchor, k)
    wanted.update((vid, hint) for vid, hint in b.added.items() if vid != hint)
    for old, new in mapping.items():
        if old != new:
            g.replace_all_uses(old, new)
    _remove_dead(g, m.nodes)
    return True


def _remove_dead(g: Graph, candidates: Sequence[str]) -> None:
    """Removes the matched nodes a rewrite left without users (never graph inputs or outputs)."""
    pending = set(candidates)
    progress = True
    while progress:
        progress = False
        for vid in sorted(pending):
            if vid in g and not g.users(vid) and vid not in g.outputs and g.node(vid).op != "input":
                g.remove(vid)
                pending.discard(vid)
                progress = True


def _in_source_order(g: Graph, sort_key: dict[str, tuple[int, ...]], wanted: dict[str, str]) -> Graph:
    """`g` rebuilt so new nodes sit where the nodes they replaced were (not at the end), under the value
    ids they asked for where those are free again."""
    rename: dict[str, str] = {}
    for vid, hint in wanted.items():
        if vid in g and hint not in g and hint not in rename.values():
            rename[vid] = hint
    out = Graph(g.name)
    for vid in nx.lexicographical_topological_sort(g.g, key=lambda v: sort_key[v]):
        node = g.node(vid)
        out.add(rename.get(vid, vid), node.with_(inputs=tuple(rename.get(i, i) for i in node.inputs)))
    out.inputs = tuple(rename.get(i, i) for i in g.inputs)
    out.outputs = tuple(rename.get(o, o) for o in g.outputs)
    return out
