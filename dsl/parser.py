"""Parses DSL text into the located AST of `kiln.dsl.ast`; syntax errors become one-line `SourceError`s."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from kiln.dsl import ast
from kiln.dsl.errors import Loc, SourceError, register_source
from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

CONFIG_TYPES = ("int", "float", "bool", "str", "list")

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"'}


class _DropNewlinesInBrackets:
    """Post-lexer: a newline inside ( ) or [ ] does not end a statement, so calls and lists may span lines."""

    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


@lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = (Path(__file__).parent / "grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer="contextual", postlex=_DropNewlinesInBrackets(),
                propagate_positions=True, maybe_placeholders=True)


def parse(text: str, file: str) -> ast.Module:
    """Parses one DSL file. Raises `SourceError` at the offending token for any syntax error."""
    register_source(file, text)
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, file) from None
    try:
        return _ToAst(file).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, SourceError):
            raise e.orig_exc from None
        raise


# ---------------------------------------------------------------- syntax errors

_EXPR_START = {"NAME", "NUMBER", "STRING", "SIZE", "TRUE", "FALSE", "LPAR", "LSQB", "MINUS", "BANG"}
_NAMED = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "SIZE": "a size",
    "_NL": "end of line", "$END": "end of file", "HOOK_AFTER": "'after'", "HOOK_BEFORE": "'before'",
}


def _describe_terminal(name: str) -> str:
    if name in _NAMED:
        return _NAMED[name]
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return name.lower()
    return f"'{pattern.value}'" if pattern.type == "str" else name.lower()


_OPERATOR_TEXT = {"+", "-", "*", "/", "//", "%", "**", "==", "!=", "<", "<=", ">", ">=", "&&", "||", "?", "|>"}


def _is_operator(name: str) -> bool:
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return False
    return pattern.type == "str" and pattern.value in _OPERATOR_TEXT


def _expected(names: set[str]) -> str:
    parts: list[str] = []
    names = set(names)
    if {"NAME", "NUMBER"} <= names:
        parts.append("an expression")
        names -= _EXPR_START
    ops = {n for n in names if _is_operator(n)}
    if len(ops) > 2:
        parts.append("an operator")
        names -= ops
    rest = sorted(_describe_terminal(n) for n in names)
    parts += rest
    if not parts:
        return ""
    if len(parts) > 5:
        parts = parts[:5] + ["…"]
        return "expected one of " + ", ".join(parts)
    return "expected " + (parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1])


def _accepted(e: UnexpectedInput) -> set[str]:
    """The terminals the parser could really take here (LALR's raw expected-sets over-approximate)."""
    parser = getattr(e, "interactive_parser", None)
    if parser is not None:
        try:
            return set(parser.accepts())
        except UnexpectedInput:  # the state cannot be replayed: fall back to lark's own set
            return set(getattr(e, "expected", ()) or ())
    return set(getattr(e, "expected", ()) or ())


def _end_of_text(text: str) -> tuple[int, int]:
    lines = text.rstrip().splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def _syntax_error(e: UnexpectedInput, text: str, file: str) -> SourceError:
    if isinstance(e, UnexpectedCharacters):
        line, col = e.line, e.column
        char = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        if char == '"':
            end = text.find("\n", e.pos_in_stream)
            end = len(text) if end < 0 else end
            return SourceError("unterminated string", Loc(file, line, col, col + end - e.pos_in_stream))
        return SourceError(f"unexpected character {char!r}", Loc(file, line, col, col + 1))
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        tok = e.token
        if tok.type == "_NL":
            what, width = "end of line", 1
        elif tok.type in ("NAME", "NUMBER", "STRING", "SIZE"):
            what, width = f"{_NAMED[tok.type][2:] if tok.type != 'NAME' else 'name'} {tok.value}", len(tok.value)
            if tok.type == "NAME":
                what = f"name '{tok.value}'"
        else:
            what, width = f"'{tok.value}'", len(tok.value)
        expected = _expected(_accepted(e))
        reason = f"unexpected {what}" + (f" — {expected}" if expected else "")
        return SourceError(reason, Loc(file, tok.line, tok.column, tok.column + width))
    if isinstance(e, (UnexpectedToken, UnexpectedEOF)):
        line, col = _end_of_text(text)
        expected = _expected(_accepted(e))
        return SourceError("unexpected end of file" + (f" — {expected}" if expected else ""),
                           Loc(file, line, col, col + 1))
    return SourceError(str(e).splitlines()[0], None)


# ---------------------------------------------------------------- tree → AST


def _is_node(x: object) -> bool:
    return x is not None


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, file: str):
        super().__init__()
        self.file = file

    # -- locations

    def _loc(self, meta) -> Loc:
        end = meta.end_column if meta.end_line == meta.line else None
        return Loc(self.file, meta.line, meta.column, end)

    def _tok(self, tok: Token) -> Loc:
        return Loc(self.file, tok.line, tok.column, tok.column + len(tok.value))

    def _span(self, start: Loc, end: Loc) -> Loc:
        return Loc(self.file, start.line, start.col, end.end_col if end.line == start.line else None)

    # -- module

    def start(self, meta, items):
        uses = tuple(i for i in items if isinstance(i, ast.UseDecl))
        models = tuple(i for i in items if isinstance(i, ast.ModelDecl))
        recipes = tuple(i for i in items if isinstance(i, ast.RecipeDecl))
        return ast.Module(self.file, uses, models, recipes, Loc(self.file, 1, 1))

    def use_name(self, meta, c):
        return ast.UseDecl(str(c[0]), False, self._tok(c[0]))

    def use_path(self, meta, c):
        return ast.UseDecl(_unquote(c[0]), True, self._tok(c[0]))

    # -- models

    def model(self, meta, c):
        name, *config, body = c
        config = tuple(p for p in config if _is_node(p))
        params = tuple(i for i in body if isinstance(i, ast.ParamDecl))
        blocks = self._resolve_likes([i for i in body if isinstance(i, ast.BlockDecl | _BlockLike)])
        forward = self._one_forward(body, name, f"model '{name}'")
        named: dict[str, ast.Forward] = {}
        for f in body:
            if isinstance(f, ast.Forward) and f.name is not None:
                if f.name in named:
                    raise SourceError(f"forward '{f.name}' is declared twice", f.loc,
                                      (f"the first is at {named[f.name].loc}",))
                named[f.name] = f
        return ast.ModelDecl(str(name), config, params, blocks, forward, self._tok(name), tuple(named.values()))

    def _resolve_likes(self, items: list) -> tuple[ast.BlockDecl, ...]:
        """`block b[n] like a` becomes a block of its own with a's params and forward (sources keep `{i}`, so
        its layers read their own checkpoint tensors)."""
        declared = {b.name: b for b in items if isinstance(b, ast.BlockDecl)}
        out = []
        for b in items:
            if isinstance(b, _BlockLike):
                like = declared.get(b.like)
                if like is None:
                    raise SourceError(f"block '{b.name}' is declared like '{b.like}', which is not a block declared "
                                      "with a body", b.like_loc, _did_you_mean_block(b.like, list(declared)))
                b = ast.BlockDecl(b.name, b.count, like.params, like.forward, b.loc)
            out.append(b)
        return tuple(out)

    def _one_forward(self, items, name: Token, what: str) -> ast.Forward:
        forwards = [i for i in items if isinstance(i, ast.Forward) and i.name is None]
        if not forwards:
            raise SourceError(f"{what} has no forward(...) {{ ... }}", self._tok(name))
        if len(forwards) > 1:
            raise SourceError(f"{what} has a second forward; only one is allowed", forwards[1].loc,
                              (f"the first is at {forwards[0].loc}",))
        return forwards[0]

    def config_param(self, meta, c):
        name, type_, default = c
        if type_ not in CONFIG_TYPES:
            raise SourceError(f"unknown config type '{type_}' — expected int, float, bool, str or list", self._tok(type_))
        return ast.ConfigParam(str(name), str(type_), default, self._tok(name))

    def model_body(self, meta, c):
        return [i for i in c if _is_node(i)]

    block_body = forward_body = recipe_body = section_body = model_body

    def param(self, meta, c):
        name, shape, source, fallback, offset, transposed, cond = c
        src = ast.Str(_unquote(source), self._tok(source)) if source is not None else None
        alt = ast.Str(_unquote(fallback), self._tok(fallback)) if fallback is not None else None
        off = float(str(offset).replace("_", "")) if offset is not None else 0.0
        return ast.ParamDecl(str(name), shape, src, cond, self._tok(name), alt, off, transposed is not None)

    def shape(self, meta, c):
        return tuple(i for i in c if _is_node(i))

    def block(self, meta, c):
        name, count, body = c
        if isinstance(body, Token):  # `like other`
            return _BlockLike(str(name), count, str(body), self._tok(name), self._tok(body))
        params = tuple(i for i in body if isinstance(i, ast.ParamDecl))
        named = next((f for f in body if isinstance(f, ast.Forward) and f.name is not None), None)
        if named is not None:
            raise SourceError(f"block '{name}' declares forward '{named.name}'; named forwards belong to the model",
                              named.loc)
        forward = self._one_forward(body, name, f"block '{name}'")
        return ast.BlockDecl(str(name), count, params, forward, self._tok(name))

    def forward(self, meta, c):
        name, *args, cond, body = c
        return ast.Forward(tuple(str(a) for a in args if a is not None), tuple(body), self._loc(meta),
                           None if name is None else str(name), cond)

    def assign(self, meta, c):
        *targets, value = c
        return ast.Assign(tuple(str(t) for t in targets), value, self._loc(meta))

    def return_stmt(self, meta, c):
        return ast.Return(c[0], self._loc(meta), tuple(c[1:]))

    # -- recipes

    def recipe(self, meta, c):
        name, body = c
        settings = tuple(i for i in body if isinstance(i, ast.Setting))
        sections = tuple(i for i in body if isinstance(i, ast.Section))
        return ast.RecipeDecl(str(name), settings, sections, self._tok(name))

    def setting(self, meta, c):
        key, value = c
        return ast.Setting(str(key), value, self._loc(meta))

    def setting_key(self, meta, c):
        return c[0]

    def section(self, meta, c):
        name, body = c
        return ast.Section(str(name), tuple(body), self._tok(name))

    def hook(self, meta, c):
        position, anchor, spec = c
        return ast.PassHook(str(position), str(anchor), ast.Str(_unquote(spec), self._tok(spec)), self._loc(meta),
                            self._tok(anchor))

    # -- expressions

    def num(self, meta, c):
        value = _number(c[0])
        if isinstance(value, float) and not math.isfinite(value):
            raise SourceError(f"number {c[0]} is too large: it is not a finite float (at most ~1.8e308)",
                              self._tok(c[0]))
        return ast.Num(value, self._tok(c[0]))

    def size(self, meta, c):
        m = re.fullmatch(r"([\d.]+)(\w+)", str(c[0]))
        return ast.Size(round(float(m.group(1)) * _SIZE_UNITS[m.group(2)]), self._tok(c[0]))

    def string(self, meta, c):
        return ast.Str(_unquote(c[0]), self._tok(c[0]))

    def true(self, meta, c):
        return ast.Bool(True, self._loc(meta))

    def false(self, meta, c):
        return ast.Bool(False, self._loc(meta))

    def name(self, meta, c):
        return ast.Name(str(c[0]), self._tok(c[0]))

    def list(self, meta, c):
        return ast.List(tuple(i for i in c if _is_node(i)), self._loc(meta))

    def map_item(self, meta, c):
        key = c[0]
        return (_unquote(key) if key.type == "STRING" else str(key), c[1], self._tok(key))

    def map(self, meta, c):
        items = [i for i in c if isinstance(i, tuple)]
        seen: dict[str, Loc] = {}
        for key, _, loc in items:
            if key in seen:
                raise SourceError(f"key '{key}' appears twice in this map", loc, (f"first at {seen[key]}",))
            seen[key] = loc
        return ast.Map(tuple((k, v) for k, v, _ in items), self._loc(meta), tuple(loc for *_, loc in items))

    def kwarg(self, meta, c):
        return _Kwarg(str(c[0]), c[1], self._tok(c[0]))

    def _call(self, func: Token, args: list, loc: Loc, piped: tuple = ()) -> ast.Call:
        positional, kwargs, kwarg_locs = list(piped), [], []
        for a in args:
            if a is None:
                continue
            if isinstance(a, _Kwarg):
                if a.name in (k for k, _ in kwargs):
                    raise SourceError(f"keyword argument '{a.name}' given twice", a.loc)
                kwargs.append((a.name, a.value))
                kwarg_locs.append(a.loc)
            elif kwargs:
                raise SourceError("positional argument after keyword arguments", a.loc)
            else:
                positional.append(a)
        return ast.Call(str(func), tuple(positional), tuple(kwargs), loc, tuple(kwarg_locs))

    def call(self, meta, c):
        return self._call(c[0], c[1:], self._loc(meta))

    def pipe_call(self, meta, c):
        lhs, func, *args = c
        # the desugared call is located at `f(b)`, the call the user wrote on the right of `|>`
        end = self._loc(meta)
        return self._call(func, args, self._span(self._tok(func), end), piped=(lhs,))

    def pipe_name(self, meta, c):
        lhs, func = c
        return self._call(func, [], self._tok(func), piped=(lhs,))

    def ternary(self, meta, c):
        return ast.Ternary(c[0], c[1], c[2], self._loc(meta))

    def or_(self, meta, c):
        return ast.BinOp("||", c[0], c[1], self._loc(meta))

    def and_(self, meta, c):
        return ast.BinOp("&&", c[0], c[1], self._loc(meta))

    def pow(self, meta, c):
        return ast.BinOp("**", c[0], c[1], self._loc(meta))

    def binop(self, meta, c):
        return ast.BinOp(str(c[1]), c[0], c[2], self._loc(meta))

    def unary(self, meta, c):
        op, operand = str(c[0]), c[1]
        loc = self._loc(meta)
        if op == "-" and isinstance(operand, ast.Num):  # `-1e-5` is a literal, not an expression
            return ast.Num(-operand.value, loc)
        return ast.UnaryOp(op, operand, loc)

    def cmp_op(self, meta, c):
        return c[0]

    add_op = mul_op = unary_op = cmp_op



class _BlockLike:
    """`block name[count] like other`, until the model's blocks are all parsed."""

    __slots__ = ("count", "like", "like_loc", "loc", "name")

    def __init__(self, name: str, count: ast.Expr, like: str, loc: Loc, like_loc: Loc):
        self.name, self.count, self.like, self.loc, self.like_loc = name, count, like, loc, like_loc


def _did_you_mean_block(name: str, options: list[str]) -> tuple[str, ...]:
    import difflib

    close = difflib.get_close_matches(name, options, n=1)
    return (f"did you mean '{close[0]}'?",) if close else ()


class _Kwarg:
    __slots__ = ("loc", "name", "value")

    def __init__(self, name: str, value: ast.Expr, loc: Loc):
        self.name, self.value, self.loc = name, value, loc


def _number(tok: Token) -> int | float:
    text = str(tok).replace("_", "")
    return float(text) if any(ch in text for ch in ".eE") else int(text)


def _unquote(tok: Token) -> str:
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), str(tok)[1:-1])
