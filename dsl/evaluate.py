"""Constant evaluation of config expressions: model config defaults, shapes, block counts, recipe values."""
from __future__ import annotations

import math
from collections.abc import Mapping

from kiln.dsl import ast
from kiln.dsl.errors import SourceError

Value = int | float | bool | str
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,),
                                     "list": (tuple, list)}
# the only calls a constant expression may make; everything else is an op of a forward body
BUILTINS = {
    "min": lambda *a: min(a),
    "max": lambda *a: max(a),
    "ceil_div": lambda a, b: -(-a // b),
}


def type_name(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (tuple, list)):
        return "list"
    return {int: "int", float: "float", str: "str"}.get(type(value), type(value).__name__)


def has_type(value: object, type_: str) -> bool:
    """`value` fits a config param of type `type_` (an int fits a float param; a bool is not an int)."""
    if isinstance(value, bool):
        return type_ == "bool"
    return isinstance(value, _TYPES[type_])


def eval_config(model: ast.ModelDecl, args: Mapping[str, ast.Expr]) -> dict[str, Value]:
    """Instantiates `model`'s config: `args` (constant expressions, e.g. a recipe's `llama(...)` keywords)
    first, then each missing param's default in declaration order, which may use earlier params.
    Int values of float params become floats. Raises `SourceError` at the offending expression."""
    known = {p.name for p in model.config}
    for key, expr in args.items():
        if key not in known:
            raise SourceError(f"model '{model.name}' has no config parameter '{key}'", expr.loc)
    env: dict[str, Value] = {}
    for p in model.config:
        if p.name in args:
            expr, what = args[p.name], f"'{p.name}'"
            value = eval_expr(expr, {})
        elif p.default is not None:
            expr, what = p.default, f"the default of '{p.name}'"
            value = eval_expr(expr, env)
        else:
            raise SourceError(f"model '{model.name}' needs config parameter '{p.name}' ({p.type})", model.loc)
        if not has_type(value, p.type):
            raise SourceError(f"{what} must be {p.type}, got {type_name(value)} {value!r}", expr.loc)
        env[p.name] = float(value) if p.type == "float" else value
    return env


def eval_expr(expr: ast.Expr, env: Mapping[str, Value]) -> Value | tuple:
    """Evaluates a constant expression over `env`. `/` is true division, `//` floor division on ints;
    `&&`, `||`, `!` and `?:` need bools. Lists evaluate to tuples."""
    match expr:
        case ast.Num(value) | ast.Str(value) | ast.Bool(value) | ast.Size(value):
            return value
        case ast.Name(id, loc):
            if id not in env:
                raise SourceError(f"undefined name '{id}'", loc)
            return env[id]
        case ast.List(items):
            return tuple(eval_expr(i, env) for i in items)
        case ast.Ternary(cond, then, else_):
            return eval_expr(then if _bool(cond, env, "a condition") else else_, env)
        case ast.UnaryOp("!", operand):
            return not _bool(operand, env, "the operand of '!'")
        case ast.UnaryOp("-", operand, loc):
            value = eval_expr(operand, env)
            if not _is_number(value):
                raise SourceError(f"cannot negate {type_name(value)} {value!r}", loc)
            return -value
        case ast.BinOp("&&", left, right):
            return _bool(left, env, "the left side of '&&'") and _bool(right, env, "the right side of '&&'")
        case ast.BinOp("||", left, right):
            return _bool(left, env, "the left side of '||'") or _bool(right, env, "the right side of '||'")
        case ast.BinOp(op, left, right, loc):
            return apply_binop(op, eval_expr(left, env), eval_expr(right, env), loc)
        case ast.Call(func, args, kwargs, loc):
            if func not in BUILTINS or kwargs:
                raise SourceError(f"'{func}(...)' is not a constant expression "
                                  f"(allowed calls: {', '.join(sorted(BUILTINS))})", loc)
            values = [eval_expr(a, env) for a in args]
            for a, v in zip(args, values):
                if not _is_number(v):
                    raise SourceError(f"'{func}' takes numbers, got {type_name(v)} {v!r}", a.loc)
            try:
                return BUILTINS[func](*values)
            except (TypeError, ValueError, ZeroDivisionError) as e:
                raise SourceError(f"'{func}': {e}", loc) from None
    raise SourceError(f"cannot evaluate {type(expr).__name__}", getattr(expr, "loc", None))


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bool(expr: ast.Expr, env: Mapping[str, Value], what: str) -> bool:
    value = eval_expr(expr, env)
    if not isinstance(value, bool):
        raise SourceError(f"{what} must be bool, got {type_name(value)} {value!r}", expr.loc)
    return value


def apply_binop(op: str, a: Value, b: Value, loc) -> Value:
    """`a op b` on config values, with the DSL's typing rules; errors are SourceErrors at `loc`."""
    if op in ("==", "!="):
        if _is_number(a) and _is_number(b) or type(a) is type(b):
            return (a == b) == (op == "==")
        raise SourceError(f"cannot compare {type_name(a)} with {type_name(b)}", loc)
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        return a + b
    if op in ("<", "<=", ">", ">=") and isinstance(a, str) and isinstance(b, str):
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
    if not (_is_number(a) and _is_number(b)):
        raise SourceError(f"'{op}' needs numbers, got {type_name(a)} {a!r} and {type_name(b)} {b!r}", loc)
    try:
        match op:
            case "+": return a + b
            case "-": return a - b
            case "*": return a * b
            case "/": return a / b
            case "//": return a // b if isinstance(a, int) and isinstance(b, int) else float(math.floor(a / b))
            case "%": return a % b
            case "**":
                if isinstance(a, int) and isinstance(b, int) and b < 0:
                    return float(a) ** b
                return a ** b
            case "<": return a < b
            case "<=": return a <= b
            case ">": return a > b
            case ">=": return a >= b
    except ZeroDivisionError:
        raise SourceError("division by zero", loc) from None
    except OverflowError:
        raise SourceError("number too large", loc) from None
    raise SourceError(f"unknown operator '{op}'", loc)
