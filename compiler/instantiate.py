"""Instantiation: a checked DSL model (+ config arguments) becomes an IR Program.

Lowering types every node as it is created, so a shape mismatch is reported at the DSL call that caused
it, with `file:line:col`. Config expressions (ternaries, arithmetic, conditions) are folded here: the IR
only holds tensors, and constants as attributes.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any

from kiln.compiler.ir import (
    Attrs,
    BlockSpec,
    Graph,
    Node,
    ParamSpec,
    PerLayer,
    Program,
    TensorType,
    TupleType,
)
from kiln.compiler.ops import OPS, ShapeError
from kiln.dsl import apply_binop, eval_config, eval_expr
from kiln.dsl import ast as A
from kiln.dsl.errors import SourceError

DTYPES = {"fp32": "f32", "f32": "f32", "bf16": "bf16", "fp16": "f16", "f16": "f16"}

_TENSOR_OPS = {"+": "add", "*": "mul"}


class _Tensor(str):
    """A value id produced by lowering (distinguishes tensors from folded constants)."""


def _did_you_mean(name: str, options: list[str]) -> tuple[str, ...]:
    close = difflib.get_close_matches(name, options, n=1)
    return (f"did you mean '{close[0]}'?",) if close else ()


class _Lowering:
    def __init__(self, model: A.ModelDecl, config: Mapping[str, Any], dtype: str):
        self.model = model
        self.config = config
        self.dtype = dtype
        self.params: dict[str, ParamSpec] = {}
        self.param_decls: dict[str, dict[str, str]] = {"": {}}  # scope -> local name -> spec name
        self.blocks: dict[str, BlockSpec] = {}
        self.block_decls = {b.name: b for b in model.blocks}
        self.graphs: dict[str, Graph] = {}
        self.lowering_block: str | None = None
        self.block_count = 0  # layers of the block being lowered (per_layer's masks have one entry per layer)

    # ------------------------------------------------------------ params and blocks
    def declare_params(self, decls: tuple[A.ParamDecl, ...], block: str | None) -> None:
        scope = self.param_decls.setdefault(block or "", {})
        for p in decls:
            if p.cond is not None and not eval_expr(p.cond, self.config):
                continue
            shape = tuple(eval_expr(e, self.config) for e in p.shape)
            for d, e in zip(shape, p.shape, strict=True):
                if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
                    raise SourceError(f"param '{p.name}' has dimension {d!r}; dimensions must be positive ints",
                                      e.loc)
            name = f"{block}.{p.name}" if block else p.name
            source = (_fill_config(p.source.value, self.config),) if p.source is not None else ()
            fallback = (_fill_config(p.fallback.value, self.config),) if p.fallback is not None else ()
            self.params[name] = ParamSpec(name, shape, self.dtype, source, block=block, loc=p.loc, fallback=fallback,
                                          offset=p.offset, transposed=p.transposed)
            scope[p.name] = name

    # ------------------------------------------------------------ graphs
    def lower_forward(self, name: str, fwd: A.Forward, arg_types: list[TensorType], scope: str) -> Graph:
        g = Graph(name)
        env: dict[str, Any] = {}
        for arg, t in zip(fwd.args, arg_types, strict=True):
            env[arg] = _Tensor(g.add(arg, Node("input", (), Attrs({"name": arg, "type": t}), t, fwd.loc)))
        for stmt in fwd.body:
            if isinstance(stmt, A.Return):
                outputs = []
                for e in stmt.values:
                    value = self.expr(g, env, scope, e)
                    if not isinstance(value, _Tensor):
                        raise SourceError("a forward must return tensors", e.loc)
                    outputs.append(value)
                g.outputs = tuple(outputs)
                return g
            self.assign(g, env, scope, stmt)
        raise SourceError(f"forward of '{name}' has no return", fwd.loc)

    def assign(self, g: Graph, env: dict[str, Any], scope: str, stmt: A.Assign) -> None:
        if len(stmt.targets) == 1:
            env[stmt.targets[0]] = self.expr(g, env, scope, stmt.value, hint=stmt.targets[0])
            return
        while isinstance(stmt.value, A.Ternary):  # `a, b = cond ? op(...) : op(...)`: the config picks the call
            cond = self.expr(g, env, scope, stmt.value.cond)
            if isinstance(cond, _Tensor):
                raise SourceError("a ternary's condition must be a config value, not a tensor", stmt.value.cond.loc)
            stmt = dataclasses.replace(stmt, value=stmt.value.then if cond else stmt.value.else_)
        call = stmt.value
        if isinstance(call, A.Call) and call.func in OPS and not OPS[call.func].per_tensor:
            self.unpack(g, env, scope, stmt)  # `weights, ids = moe_topk_softmax(...)`: a tuple-valued op
            return
        if not (isinstance(call, A.Call) and call.func in OPS and OPS[call.func].per_tensor):
            raise SourceError(f"{len(stmt.targets)} targets need an op applied per tensor (such as rope)",
                              stmt.loc)
        if len(call.args) != len(stmt.targets):
            raise SourceError(f"{len(stmt.targets)} targets but {call.func} has {len(call.args)} tensor arguments",
                              stmt.loc)
        outs = [self.call(g, env, scope, A.Call(call.func, (a,), call.kwargs, call.loc), hint=t)
                for a, t in zip(call.args, stmt.targets, strict=True)]
        env.update(zip(stmt.targets, outs, strict=True))

    def unpack(self, g: Graph, env: dict[str, Any], scope: str, stmt: A.Assign) -> None:
        """`a, b = op(...)` for a tuple-valued op: one `getitem` per target."""
        value = self.call(g, env, scope, stmt.value, hint=stmt.targets[0] + "_" + stmt.targets[-1])
        out = g.node(value).out
        if not isinstance(out, TupleType) or len(out.items) != len(stmt.targets):
            have = f"{len(out.items)} values" if isinstance(out, TupleType) else "one tensor"
            raise SourceError(f"{len(stmt.targets)} targets but {stmt.value.func} returns {have}", stmt.loc)
        for k, target in enumerate(stmt.targets):
            env[target] = self.emit(g, "getitem", (value,), {"index": k}, stmt.loc, target)

    def expr(self, g: Graph, env: dict[str, Any], scope: str, e: A.Expr, hint: str | None = None) -> Any:
        if isinstance(e, A.Num | A.Str | A.Bool | A.Size):
            return e.value
        if isinstance(e, A.List):
            return [self.expr(g, env, scope, x) for x in e.items]
        if isinstance(e, A.Name):
            return self.name(g, env, scope, e)
        if isinstance(e, A.Ternary):
            cond = self.expr(g, env, scope, e.cond)
            if isinstance(cond, _Tensor):
                raise SourceError("a ternary's condition must be a config value, not a tensor", e.cond.loc)
            return self.expr(g, env, scope, e.then if cond else e.else_, hint)
        if isinstance(e, A.UnaryOp):
            v = self.expr(g, env, scope, e.operand)
            if isinstance(v, _Tensor):
                raise SourceError(f"unary '{e.op}' is not defined on tensors", e.loc)
            return -v if e.op == "-" else not v
        if isinstance(e, A.BinOp):
            return self.binop(g, env, scope, e, hint)
        if isinstance(e, A.Call):
            return self.call(g, env, scope, e, hint)
        raise SourceError(f"unsupported expression {type(e).__name__}", getattr(e, "loc", None))

    def name(self, g: Graph, env: dict[str, Any], scope: str, e: A.Name) -> Any:
        if e.id in env:
            return env[e.id]
        for sc in (scope, ""):
            spec_name = self.param_decls.get(sc, {}).get(e.id)
            if spec_name is not None:
                vid = f"{e.id}" if e.id not in g else None
                if vid is None:  # a param node for this spec may already exist
                    for v, n in g.g.nodes(data="node"):  # at most one per spec: no need to sort
                        if n.op == "param" and n.attrs["name"] == spec_name:
                            return _Tensor(v)
                    vid = g.fresh(e.id)
                spec = self.params[spec_name]
                t = TensorType(spec.shape, spec.dtype)
                env[e.id] = _Tensor(g.add(vid, Node("param", (), Attrs({"name": spec_name, "type": t}), t, e.loc)))
                return env[e.id]
        if e.id in self.config:
            return self.config[e.id]
        declared = any(p.name == e.id for b in self.model.blocks for p in b.params) or any(
            p.name == e.id for p in self.model.params)
        if declared:
            raise SourceError(f"param '{e.id}' is absent in this configuration (its `if` condition is false)",
                              e.loc)
        raise SourceError(f"undefined name '{e.id}'", e.loc, _did_you_mean(e.id, [*env, *self.config]))

    def binop(self, g: Graph, env: dict[str, Any], scope: str, e: A.BinOp, hint: str | None) -> Any:
        if e.op in ("&&", "||"):
            left = self.expr(g, env, scope, e.left)
            if isinstance(left, _Tensor):
                raise SourceError(f"'{e.op}' is not defined on tensors", e.loc)
            if (e.op == "&&" and not left) or (e.op == "||" and left):
                return left
            return self.expr(g, env, scope, e.right)
        left, right = self.expr(g, env, scope, e.left), self.expr(g, env, scope, e.right)
        lt, rt = isinstance(left, _Tensor), isinstance(right, _Tensor)
        if not lt and not rt:
            return apply_binop(e.op, left, right, e.loc)
        if lt and rt and e.op in _TENSOR_OPS:
            return self.emit(g, _TENSOR_OPS[e.op], (left, right), {}, e.loc, hint)
        raise SourceError(f"operator '{e.op}' is not defined between "
                          f"{'a tensor' if lt else 'a constant'} and {'a tensor' if rt else 'a constant'}", e.loc)

    def call(self, g: Graph, env: dict[str, Any], scope: str, e: A.Call, hint: str | None = None) -> Any:
        if e.func in self.block_decls:
            if len(e.args) != 1 or e.kwargs:
                raise SourceError(f"block '{e.func}' takes one tensor argument", e.loc)
            h = self.expr(g, env, scope, e.args[0])
            if not isinstance(h, _Tensor):
                raise SourceError(f"block '{e.func}' takes a tensor", e.args[0].loc)
            self.lower_block(e.func, g.node(h).out, e.loc)
            return self.emit(g, "block", (h,), {"block": e.func}, e.loc, hint or e.func)
        if e.func == "per_layer":
            return self.per_layer(g, env, scope, e)
        op = OPS.get(e.func)
        if op is None or e.func in ("input", "param", "block", "getitem"):
            known = sorted(k for k in OPS if k not in ("input", "param", "block", "getitem"))
            raise SourceError(f"unknown op '{e.func}'", e.loc, _did_you_mean(e.func, known + list(self.block_decls)))
        tensors: list[str] = []
        varargs: list[Any] = []
        for a in e.args:
            v = self.expr(g, env, scope, a)
            if isinstance(v, _Tensor):
                if varargs:
                    raise SourceError("tensor arguments come before constant ones", a.loc)
                tensors.append(v)
            elif op.varargs_attr is not None:
                varargs.append(v)
            else:
                raise SourceError(f"op '{e.func}' takes tensors positionally; pass constants by keyword", a.loc)
        attrs: dict[str, Any] = {}
        if varargs:
            attrs[op.varargs_attr] = tuple(varargs)
        for key, val in e.kwargs:
            if key not in op.attrs:
                raise SourceError(f"op '{e.func}' has no attribute '{key}'", val.loc,
                                  _did_you_mean(key, list(op.attrs)) or (f"known: {', '.join(op.attrs) or 'none'}",))
            v = self.expr(g, env, scope, val)
            if isinstance(v, _Tensor):
                raise SourceError(f"attribute '{key}' must be a config value, not a tensor", val.loc)
            attrs[key] = v
        if not op.min_inputs <= len(tensors) <= op.max_inputs:
            want = op.min_inputs if op.min_inputs == op.max_inputs else f"{op.min_inputs}-{op.max_inputs}"
            raise SourceError(f"op '{e.func}' takes {want} tensor arguments, got {len(tensors)}", e.loc)
        return self.emit(g, e.func, tuple(tensors), attrs, e.loc, hint)

    def per_layer(self, g: Graph, env: dict[str, Any], scope: str, e: A.Call) -> Any:
        """`per_layer(mask, a, b)`: an attribute value that is `a` at the block's layers where the config list
        `mask` is true and `b` at the others (Gemma's sliding-window and global attention layers). The same value
        at every layer is that plain value."""
        if self.lowering_block is None:
            raise SourceError("per_layer(...) is an attribute value inside a block's forward", e.loc)
        if len(e.args) != 3 or e.kwargs:
            raise SourceError("per_layer takes three arguments: per_layer(mask, a, b)", e.loc)
        mask, a, b = (self.expr(g, env, scope, x) for x in e.args)
        if any(isinstance(v, _Tensor) for v in (mask, a, b)):
            raise SourceError("per_layer picks between config values, not tensors", e.loc)
        count = self.block_count
        if not (isinstance(mask, list | tuple) and all(isinstance(m, bool) for m in mask)):
            raise SourceError(f"per_layer's mask must be a list of bools, one per layer, got {mask!r}", e.args[0].loc)
        if len(mask) != count:
            raise SourceError(f"per_layer's mask has {len(mask)} entries; block '{self.lowering_block}' has {count} "
                              "layers", e.args[0].loc)
        values = tuple(a if m else b for m in mask)
        return values[0] if len(set(values)) == 1 else PerLayer(values)

    def emit(self, g: Graph, op: str, inputs: tuple[str, ...], attrs: dict[str, Any], loc, hint) -> _Tensor:
        a = Attrs(attrs)
        try:
            out = OPS[op].infer([g.node(i).out for i in inputs], a)
        except ShapeError as err:
            raise SourceError(f"{op}: {err}", loc) from None
        return _Tensor(g.add(g.fresh(hint or op), Node(op, inputs, a, out, loc)))

    def lower_block(self, name: str, arg_type: TensorType, loc) -> None:
        decl = self.block_decls[name]
        if name in self.graphs:
            # each call would be its own run of layers, but the block has one set of layer weights
            raise SourceError(f"block '{name}' is called twice; a block's layers run once, in one place of the "
                              "layer schedule (declare another block for more layers)", loc)
        if self.lowering_block is not None:
            raise SourceError(f"block '{self.lowering_block}' calls block '{name}'; blocks are called only from "
                              "the model's forward", loc)
        count = eval_expr(decl.count, self.config)
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise SourceError(f"block '{name}' repeats {count!r} times; expected a positive int", decl.count.loc)
        if len(decl.forward.args) != 1:
            raise SourceError(f"block '{name}' forward must take one argument", decl.forward.loc)
        self.declare_params(decl.params, name)
        first_layer = sum(b.count for b in self.blocks.values())  # blocks are lowered in call order
        self.lowering_block, self.block_count = name, count
        self.graphs[name] = self.lower_forward(name, decl.forward, [arg_type], name)
        self.lowering_block = None
        if len(self.graphs[name].outputs) != 1:
            raise SourceError(f"block '{name}' must return one tensor, the next hidden state", decl.forward.loc)
        out = self.graphs[name].node(self.graphs[name].outputs[0]).out
        if out != arg_type:
            raise SourceError(f"block '{name}' must return its input's type {arg_type}, returns {out}",
                              decl.forward.loc)
        self.blocks[name] = BlockSpec(name, name, count, first_layer)


def _fill_config(source: str, config: Mapping[str, Any]) -> str:
    """Substitutes config values named in a tensor name ("model.layers.{layers}.enorm.weight"); `{i}` and `{e}`
    stay for the weight converter."""
    return re.sub(r"\{(\w+)\}", lambda m: str(config[m.group(1)]) if m.group(1) in config else m.group(0), source)


def instantiate_model(model: A.ModelDecl, args: Mapping[str, A.Expr], dtype: str = "f32",
                      meta: Mapping[str, Any] | None = None) -> Program:
    """Lowers `model` with config arguments (DSL expressions) to a typed Program."""
    config = eval_config(model, dict(args))
    low = _Lowering(model, config, DTYPES.get(dtype, dtype))
    low.declare_params(model.params, None)
    if len(model.forward.args) != 1:
        raise SourceError("a model's forward takes one argument: the token ids", model.forward.loc)
    tokens = TensorType(("T",), "i32")
    entry = low.lower_forward("entry", model.forward, [tokens], "")
    hidden = [entry.node(o).out for o in entry.outputs[1:]]
    for f in model.forwards:
        if f.cond is not None and not eval_expr(f.cond, config):
            continue
        if len(f.args) != 1 + len(hidden):
            raise SourceError(f"forward '{f.name}' takes the token ids and the {len(hidden)} hidden state(s) the "
                              f"model's forward returns after its logits: {1 + len(hidden)} arguments, not "
                              f"{len(f.args)}", f.loc)
        # lowered after the entry graph, so the blocks it calls take the next global layer indices
        low.graphs[f.name] = low.lower_forward(f.name, f, [tokens, *hidden], "")
    graphs = {"entry": entry, **low.graphs}
    used = {n.attrs["name"] for g in graphs.values() for _, n in g.items() if n.op == "param"}
    params = {k: v for k, v in low.params.items() if k in used}
    return Program(model.name, dict(config), params, graphs, dict(low.blocks), low.dtype, dict(meta or {}))
