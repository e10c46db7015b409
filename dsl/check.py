"""Semantic checks of models and recipes; each failure is a `SourceError` at the node that is wrong."""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from kiln.dsl import ast
from kiln.dsl.errors import Loc, SourceError
from kiln.dsl.evaluate import BUILTINS, Value, eval_config, eval_expr, has_type, type_name

__all__ = ["check_model", "check_module", "check_recipe", "eval_config", "eval_expr"]

TARGETS = ("cpu", "h100", "h200")
DTYPES = ("fp32", "bf16", "fp16")


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" — did you mean '{close[0]}'?" if close else ""


def _key_loc(setting: ast.Setting) -> Loc:
    return replace(setting.loc, end_col=setting.loc.col + len(setting.key))


def _walk(expr: ast.Expr) -> Iterable[ast.Expr]:
    """`expr` and every sub-expression, pre-order, left to right."""
    yield expr
    match expr:
        case ast.BinOp(_, left, right):
            children = (left, right)
        case ast.UnaryOp(_, operand):
            children = (operand,)
        case ast.Ternary(cond, then, else_):
            children = (cond, then, else_)
        case ast.Call(_, args, kwargs):
            children = (*args, *(v for _, v in kwargs))
        case ast.List(items):
            children = items
        case _:
            children = ()
    for child in children:
        yield from _walk(child)


def _names(expr: ast.Expr) -> Iterable[ast.Name]:
    """Every `Name` read by `expr` (call targets are not names)."""
    return (e for e in _walk(expr) if isinstance(e, ast.Name))


def _calls(expr: ast.Expr) -> Iterable[ast.Call]:
    return (e for e in _walk(expr) if isinstance(e, ast.Call))


# ---------------------------------------------------------------- models


def check_module(module: ast.Module) -> None:
    """Checks every model of a module (recipes need the models they use: see `check_recipe`)."""
    seen: dict[str, ast.ModelDecl] = {}
    for model in module.models:
        if model.name in seen:
            raise SourceError(f"model '{model.name}' is declared twice", model.loc,
                              (f"the first declaration is at {seen[model.name].loc}",))
        seen[model.name] = model
        check_model(model)
    recipes: dict[str, ast.RecipeDecl] = {}
    for recipe in module.recipes:
        if recipe.name in recipes:
            raise SourceError(f"recipe '{recipe.name}' is declared twice", recipe.loc,
                              (f"the first declaration is at {recipes[recipe.name].loc}",))
        recipes[recipe.name] = recipe


class _Scope:
    """Names declared so far in one namespace, with where, to report duplicates precisely."""

    def __init__(self, parent: _Scope | None = None):
        self.parent = parent
        self.kinds: dict[str, tuple[str, Loc]] = {}

    def lookup(self, name: str) -> tuple[str, Loc] | None:
        if name in self.kinds:
            return self.kinds[name]
        return self.parent.lookup(name) if self.parent else None

    def declare(self, name: str, kind: str, loc: Loc) -> None:
        prev = self.lookup(name)
        if prev is not None:
            what = "declared twice" if prev[0] == kind else f"already the name of a {prev[0]}"
            raise SourceError(f"{kind} '{name}' is {what}", loc, (f"'{name}' is declared at {prev[1]}",))
        self.kinds[name] = (kind, loc)

    def all_names(self) -> set[str]:
        return set(self.kinds) | (self.parent.all_names() if self.parent else set())


def check_model(model: ast.ModelDecl) -> None:
    config = _Scope()
    for p in model.config:
        if p.default is not None:
            _check_config_expr(p.default, config, model, f"the default of '{p.name}'")
        config.declare(p.name, "config parameter", p.loc)

    top = _Scope(config)
    for b in model.blocks:
        top.declare(b.name, "block", b.loc)
    for p in model.params:
        _check_param(p, config, model, in_block=False)
        top.declare(p.name, "param", p.loc)
    blocks = {b.name for b in model.blocks}
    for b in model.blocks:
        _check_config_expr(b.count, config, model, f"the layer count of block '{b.name}'")
        inner = _Scope(top)
        for p in b.params:
            _check_param(p, config, model, in_block=True)
            inner.declare(p.name, "param", p.loc)
        _check_forward(b.forward, inner, blocks, config)
    _check_forward(model.forward, top, blocks, config)
    for f in model.forwards:
        if f.cond is not None:
            _check_config_expr(f.cond, config, model, f"the condition of forward '{f.name}'")
        if f.name in top.all_names():
            raise SourceError(f"forward '{f.name}' has the name of a {top.lookup(f.name)[0]}", f.loc)
        _check_forward(f, top, blocks, config)


def _check_config_expr(expr: ast.Expr, config: _Scope, model: ast.ModelDecl, what: str) -> None:
    for call in _calls(expr):
        if call.func not in BUILTINS:
            raise SourceError(f"'{call.func}(...)' cannot be used in {what}: it must be a constant expression "
                              f"(allowed calls: {', '.join(sorted(BUILTINS))})", call.loc)
    declared = config.all_names()
    for name in _names(expr):
        if name.id in declared:
            continue
        later = [p for p in model.config if p.name == name.id]
        if later:
            raise SourceError(f"'{name.id}' is used in {what} before it is declared", name.loc,
                              (f"config parameter '{name.id}' is declared at {later[0].loc}",))
        raise SourceError(f"undefined name '{name.id}' in {what}: only config parameters are visible here"
                          + _did_you_mean(name.id, [p.name for p in model.config]), name.loc)


def _check_param(p: ast.ParamDecl, config: _Scope, model: ast.ModelDecl, in_block: bool) -> None:
    for dim in p.shape:
        _check_config_expr(dim, config, model, f"the shape of '{p.name}'")
    if p.cond is not None:
        _check_config_expr(p.cond, config, model, f"the condition of '{p.name}'")
    for src in (p.source, p.fallback):
        if src is None:
            continue
        for m in re.finditer(r"\{([^}]*)\}", src.value):
            if m.group(1) == "e":  # expert index: the param is a stack over experts along its dim 0
                if len(p.shape) < 2:
                    raise SourceError(f"'{{e}}' (the expert index) stacks one tensor per expert along dim 0, so "
                                      f"'{p.name}' needs a shape [experts, ...] of rank >= 2", src.loc)
                continue
            if m.group(1) in config.kinds:  # a config value, e.g. the first MTP layer "model.layers.{layers}"
                continue
            if m.group(1) != "i":
                raise SourceError(f"unknown placeholder '{{{m.group(1)}}}' in a tensor name: only '{{i}}', "
                                  "the layer index, '{e}', the expert index, and config parameters are defined",
                                  src.loc)
            if not in_block:
                raise SourceError("'{i}' (the layer index) is defined only for params inside a block",
                                  src.loc)


def _check_forward(fwd: ast.Forward, outer: _Scope, blocks: set[str], config: _Scope) -> None:
    scope = _Scope(outer)
    for arg in fwd.args:
        scope.declare(arg, "forward argument", fwd.loc)
    locals_: set[str] = set(fwd.args)
    if not fwd.body or not isinstance(fwd.body[-1], ast.Return):
        loc = fwd.body[-1].loc if fwd.body else fwd.loc
        raise SourceError("forward must end with 'return'", loc)
    for i, stmt in enumerate(fwd.body):
        if isinstance(stmt, ast.Return) and i != len(fwd.body) - 1:
            raise SourceError("statement after 'return' is never run", fwd.body[i + 1].loc)
        for value in stmt.values if isinstance(stmt, ast.Return) else (stmt.value,):
            _check_body_expr(value, scope, locals_, blocks, config)
        if isinstance(stmt, ast.Assign):
            seen: set[str] = set()
            for t in stmt.targets:
                if t in seen:
                    raise SourceError(f"'{t}' is assigned twice in one statement", stmt.loc)
                seen.add(t)
                if t not in locals_:
                    prev = outer.lookup(t)
                    if prev is not None:
                        raise SourceError(f"local '{t}' would shadow the {prev[0]} '{t}'", stmt.loc,
                                          (f"'{t}' is declared at {prev[1]}",))
                locals_.add(t)


def _check_body_expr(expr: ast.Expr, scope: _Scope, locals_: set[str], blocks: set[str], config: _Scope) -> None:
    for name in _names(expr):
        if name.id in locals_:
            continue
        found = scope.lookup(name.id)
        if found is None:
            visible = locals_ | scope.all_names()
            raise SourceError(f"undefined name '{name.id}'" + _did_you_mean(name.id, visible), name.loc)
        if found[0] == "block":
            raise SourceError(f"block '{name.id}' is not a value; call it, e.g. {name.id}(h)", name.loc)
    for call in _calls(expr):
        found = None if call.func in locals_ else scope.lookup(call.func)
        if call.func in locals_ or (found is not None and found[0] != "block"):
            kind = "local" if found is None else found[0]
            raise SourceError(f"'{call.func}' is a {kind}, not an op or a block", call.loc)
    _check_ternaries(expr, config)


def _check_ternaries(expr: ast.Expr, config: _Scope) -> None:
    """A `?:` in a forward picks between tensors at compile time, so its condition reads config only."""
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, ast.Ternary):
            for name in _names(e.cond):
                if config.lookup(name.id) is None:
                    raise SourceError(f"the condition of '?:' must be a config expression; '{name.id}' is not "
                                      "a config parameter", name.loc)
            stack += [e.cond, e.then, e.else_]
        elif isinstance(e, ast.BinOp):
            stack += [e.left, e.right]
        elif isinstance(e, ast.UnaryOp):
            stack.append(e.operand)
        elif isinstance(e, ast.Call):
            stack += [*e.args, *(v for _, v in e.kwargs)]
        elif isinstance(e, ast.List):
            stack += list(e.items)


# ---------------------------------------------------------------- recipes


def check_recipe(recipe: ast.RecipeDecl, models: Mapping[str, ast.ModelDecl]) -> dict[str, Value]:
    """Checks a recipe against the models visible to it; returns the instantiated model config."""
    settings: dict[str, ast.Setting] = {}
    for s in recipe.settings:
        if s.key in settings:
            raise SourceError(f"'{s.key}' is set twice", _key_loc(s), (f"first set at {settings[s.key].loc}",))
        if s.key not in _TOP_LEVEL:
            note = f"recipe settings are {', '.join(_TOP_LEVEL)}; sections are {', '.join(_SECTIONS)}"
            raise SourceError(f"unknown recipe setting '{s.key}'" + _did_you_mean(s.key, _TOP_LEVEL), _key_loc(s),
                              (note,))
        settings[s.key] = s
    if "model" not in settings:
        raise SourceError(f"recipe '{recipe.name}' has no 'model = NAME(...)'", recipe.loc)
    for key, s in settings.items():
        if key != "model":
            _TOP_LEVEL[key](s.value, key)

    sections: dict[str, ast.Section] = {}
    for sec in recipe.sections:
        if sec.name in sections:
            raise SourceError(f"section '{sec.name}' appears twice", sec.loc,
                              (f"first at {sections[sec.name].loc}",))
        if sec.name not in _SECTIONS:
            raise SourceError(f"unknown section '{sec.name}'" + _did_you_mean(sec.name, _SECTIONS), sec.loc,
                              (f"sections are {', '.join(_SECTIONS)}",))
        sections[sec.name] = sec
        _check_section(sec)
    return _check_model_call(settings["model"].value, models)


def _check_model_call(value: ast.Expr, models: Mapping[str, ast.ModelDecl]) -> dict[str, Value]:
    if not isinstance(value, ast.Call):
        raise SourceError("'model' must be a model instantiation such as llama(vocab=32000, hidden=4096, ...)",
                          value.loc)
    model = models.get(value.func)
    if model is None:
        raise SourceError(f"unknown model '{value.func}'" + _did_you_mean(value.func, models),
                          replace(value.loc, end_col=value.loc.col + len(value.func)),
                          (f"known models: {', '.join(sorted(models)) or 'none'}",))
    if value.args:
        raise SourceError("model config arguments must be named, e.g. hidden=4096", value.args[0].loc)
    params = {p.name: p for p in model.config}
    args: dict[str, ast.Expr] = {}
    for i, (key, expr) in enumerate(value.kwargs):
        key_loc = value.kwarg_locs[i] if i < len(value.kwarg_locs) else expr.loc
        p = params.get(key)
        if p is None:
            raise SourceError(f"model '{model.name}' has no config parameter '{key}'" + _did_you_mean(key, params),
                              key_loc, (f"'{model.name}' is declared at {model.loc}",))
        v = _literal(expr, f"'{key}'", p.type)
        if not has_type(v, p.type):
            raise SourceError(f"'{key}' is {p.type}, got {type_name(v)} {v!r}", expr.loc)
        args[key] = expr
    missing = [p for p in model.config if p.default is None and p.name not in args]
    if missing:
        names = ", ".join(f"{p.name}: {p.type}" for p in missing)
        raise SourceError(f"model '{model.name}' needs {names}",
                          replace(value.loc, end_col=value.loc.col + len(value.func)),
                          (f"'{model.name}' is declared at {model.loc}",))
    return eval_config(model, args)


def _literal(expr: ast.Expr, what: str, expected: str) -> Value | tuple:
    """A recipe value: a constant expression. A bare name is reported as a value of the wrong kind."""
    if isinstance(expr, ast.Name):
        raise SourceError(f"{what} must be {expected}, got the name '{expr.id}'"
                          + (f' (a string is written "{expr.id}")' if expected == "str" else ""), expr.loc)
    return eval_expr(expr, {})


# -- value validators: each takes (expr, key) and raises at expr.loc

Validator = Callable[[ast.Expr, str], None]


def _pos_int(expr: ast.Expr, key: str) -> None:
    v = _literal(expr, f"'{key}'", "a positive int")
    if not (type_name(v) == "int" and v > 0):
        raise SourceError(f"'{key}' must be a positive int, got {v!r}", expr.loc)


def _power_of_two(expr: ast.Expr, key: str) -> None:
    _pos_int(expr, key)
    v = eval_expr(expr, {})
    if v & (v - 1):
        raise SourceError(f"'{key}' must be a power of two, got {v}", expr.loc)


def _fraction(expr: ast.Expr, key: str) -> None:
    v = _literal(expr, f"'{key}'", "a number in (0, 1]")
    if type_name(v) not in ("int", "float") or not 0 < v <= 1:
        raise SourceError(f"'{key}' must be a number in (0, 1], got {v!r}", expr.loc)


def _port(expr: ast.Expr, key: str) -> None:
    v = _literal(expr, f"'{key}'", "a port number")
    if type_name(v) != "int" or not 0 < v < 65536:
        raise SourceError(f"'{key}' must be a port number in 1..65535, got {v!r}", expr.loc)


def _string(expr: ast.Expr, key: str) -> None:
    if not isinstance(expr, ast.Str) or not expr.value:
        raise SourceError(f"'{key}' must be a non-empty string", expr.loc)


def _choice(*choices: str) -> Validator:
    def check(expr: ast.Expr, key: str) -> None:
        name = expr.id if isinstance(expr, ast.Name) else expr.value if isinstance(expr, ast.Str) else None
        if name not in choices:
            shown = name if name is not None else "this"
            raise SourceError(f"'{key}' must be one of {', '.join(choices)}, not '{shown}'"
                              + (_did_you_mean(name, choices) if name else ""), expr.loc)
    return check


def _flag(expr: ast.Expr, key: str) -> None:
    if not isinstance(expr, ast.Bool):
        raise SourceError(f"'{key}' must be true or false", expr.loc)


def _symbol(expr: ast.Expr, key: str) -> None:
    if not isinstance(expr, ast.Name):
        raise SourceError(f"'{key}' must be a name such as fp8 or auto", expr.loc)


def _scheme(expr: ast.Expr, key: str) -> None:
    """`fp8` or `fp8(block=128)`: the scheme names belong to the compiler's quantization registry."""
    if not isinstance(expr, (ast.Name, ast.Call)):
        raise SourceError(f"'{key}' must be a scheme such as fp8 or fp8(block=128)", expr.loc)
    if isinstance(expr, ast.Call):
        for _, v in expr.kwargs:
            if not isinstance(v, ast.Name):  # `fp8(block=128)`, `awq(group=128, zero_point=true)`
                eval_expr(v, {})


def _weights(expr: ast.Expr, key: str) -> None:
    if isinstance(expr, ast.Str) and expr.value:
        return
    if isinstance(expr, ast.Call) and expr.func == "random" and not expr.args:
        for i, (k, v) in enumerate(expr.kwargs):
            if k != "seed":
                loc = expr.kwarg_locs[i] if i < len(expr.kwarg_locs) else v.loc
                raise SourceError(f"random(...) takes only seed=, not '{k}'", loc)
            if type_name(_literal(v, "'seed'", "int")) != "int":
                raise SourceError("'seed' must be an int", v.loc)
        return
    raise SourceError('\'weights\' must be a checkpoint such as "hf:./path" or random(seed=0)', expr.loc)


def _offload(expr: ast.Expr, key: str) -> None:
    if isinstance(expr, ast.Name) and expr.id == "none":
        return
    if (isinstance(expr, ast.Call) and expr.func == "cpu" and len(expr.args) == 1 and not expr.kwargs
            and isinstance(expr.args[0], ast.Size) and expr.args[0].value > 0):
        return
    raise SourceError("'offload' must be cpu(SIZE), e.g. cpu(16GiB), or none", expr.loc)


def _chunked_prefill(expr: ast.Expr, key: str) -> None:
    if isinstance(expr, ast.Bool):
        return
    _pos_int(expr, key)


def _batch_sizes(expr: ast.Expr, key: str) -> None:
    if not isinstance(expr, ast.List) or not expr.items:
        raise SourceError(f"'{key}' must be a list of positive ints, e.g. [1, 2, 4, 8]", expr.loc)
    for item in expr.items:
        _pos_int(item, key)


def _draft(expr: ast.Expr, key: str) -> None:
    if not isinstance(expr, (ast.Str, ast.Call)):
        raise SourceError("'draft' must be a checkpoint string or a model instantiation", expr.loc)


def _size(expr: ast.Expr, key: str) -> None:
    if not (isinstance(expr, ast.Size) and expr.value > 0):
        raise SourceError(f"'{key}' must be a byte size such as 4GiB", expr.loc)


def _disable(expr: ast.Expr, key: str) -> None:
    if not isinstance(expr, ast.List) or not all(isinstance(i, (ast.Name, ast.Str)) for i in expr.items):
        raise SourceError("'disable' must be a list of pass names, e.g. [fuse_qkv]", expr.loc)


_TOP_LEVEL: dict[str, Validator] = {
    "model": lambda e, k: None,  # checked against the visible models by _check_model_call
    "weights": _weights,
    "target": _choice(*TARGETS),
    "dtype": _choice(*DTYPES),
}

_SECTIONS: dict[str, dict[str, Validator]] = {
    "quantize": {"weights": _scheme, "kv_cache": _scheme},
    "parallel": {"tp": _pos_int, "dp": _pos_int, "ep": _pos_int, "pp": _pos_int},
    "kv_cache": {"block_size": _power_of_two, "memory_fraction": _fraction, "offload": _offload,
                 "num_blocks": _pos_int},
    "scheduler": {"max_seqs": _pos_int, "max_batched_tokens": _pos_int, "chunked_prefill": _chunked_prefill,
                  "policy": _choice("fcfs", "priority", "effort"), "prefix_cache": _choice("radix", "none"),
                  "preemption": _choice("recompute", "swap"), "swap_space": _size, "async_scheduling": _flag},
    "speculative": {"method": _symbol, "tokens": _pos_int, "draft": _draft},
    "lora": {"max_loras": _pos_int, "max_rank": _pos_int},
    "cuda_graphs": {"batch_sizes": _batch_sizes},
    "disaggregate": {"prefill": _pos_int, "decode": _pos_int, "transport": _symbol},
    "serve": {"port": _port, "host": _string, "served_name": _string, "max_model_len": _pos_int},
    "passes": {"disable": _disable},
}


def _check_section(sec: ast.Section) -> None:
    keys = _SECTIONS[sec.name]
    seen: dict[str, ast.Setting] = {}
    for entry in sec.entries:
        if isinstance(entry, ast.PassHook):
            if sec.name != "passes":
                raise SourceError(f"'{entry.position} {entry.anchor}: ...' belongs in the passes section",
                                  entry.loc)
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", entry.spec.value):
                raise SourceError(f"a pass is named \"package.module:Class\", got \"{entry.spec.value}\"",
                                  entry.spec.loc)
            continue
        if entry.key not in keys:
            raise SourceError(f"unknown key '{entry.key}' in section '{sec.name}'" + _did_you_mean(entry.key, keys),
                              _key_loc(entry), (f"'{sec.name}' takes {', '.join(keys)}",))
        if entry.key in seen:
            raise SourceError(f"'{entry.key}' is set twice in section '{sec.name}'", _key_loc(entry),
                              (f"first set at {seen[entry.key].loc}",))
        seen[entry.key] = entry
        keys[entry.key](entry.value, entry.key)
