"""AST of the kiln DSL: `model` and `recipe` declarations. Plain frozen dataclasses, every node located."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.dsl.errors import Loc

# ---------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class Num:
    value: int | float
    loc: Loc


@dataclass(frozen=True, slots=True)
class Str:
    value: str
    loc: Loc


@dataclass(frozen=True, slots=True)
class Bool:
    value: bool
    loc: Loc


@dataclass(frozen=True, slots=True)
class Size:
    """A byte size literal such as `16GiB` or `512MB`; `value` is in bytes."""

    value: int
    loc: Loc


@dataclass(frozen=True, slots=True)
class Name:
    id: str
    loc: Loc


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # + - * / // % ** == != < <= > >= && ||
    left: Expr
    right: Expr
    loc: Loc


@dataclass(frozen=True, slots=True)
class UnaryOp:
    op: str  # - !
    operand: Expr
    loc: Loc


@dataclass(frozen=True, slots=True)
class Ternary:
    cond: Expr
    then: Expr
    else_: Expr
    loc: Loc


@dataclass(frozen=True, slots=True)
class Call:
    """`f(a, b, k=v)`. The pipe `a |> f(b)` is desugared by the parser into `f(a, b)`."""

    func: str
    args: tuple[Expr, ...]
    kwargs: tuple[tuple[str, Expr], ...]
    loc: Loc
    # where each keyword's name is written (parallel to `kwargs`), so errors can point at `hiden=` itself
    kwarg_locs: tuple[Loc, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class List:
    items: tuple[Expr, ...]
    loc: Loc


@dataclass(frozen=True, slots=True)
class Map:
    """`{ key: value, ... }` (a recipe value, e.g. lora adapters); keys are unique, in the order written."""

    items: tuple[tuple[str, Expr], ...]
    loc: Loc
    key_locs: tuple[Loc, ...] = field(default=(), compare=False)


Expr = Num | Str | Bool | Size | Name | BinOp | UnaryOp | Ternary | Call | List | Map

# ---------------------------------------------------------------- forward bodies


@dataclass(frozen=True, slots=True)
class Assign:
    targets: tuple[str, ...]  # `q, k = rope(q, k, ...)` has two targets
    value: Expr
    loc: Loc


@dataclass(frozen=True, slots=True)
class Return:
    """`return x`, or `return logits, h`: a model's forward may return, after its logits, the hidden states
    its named forwards (draft heads) read."""

    value: Expr
    loc: Loc
    more: tuple[Expr, ...] = ()

    @property
    def values(self) -> tuple[Expr, ...]:
        return (self.value, *self.more)


Stmt = Assign | Return


@dataclass(frozen=True, slots=True)
class Forward:
    args: tuple[str, ...]
    body: tuple[Stmt, ...]
    loc: Loc
    name: str | None = None  # None: the model's (or a block's) forward; else a second entry such as `mtp`
    cond: Expr | None = None  # a named forward exists only when this config expression is true


# ---------------------------------------------------------------- model declarations


@dataclass(frozen=True, slots=True)
class ConfigParam:
    name: str
    type: str  # int | float | bool | str
    default: Expr | None
    loc: Loc


@dataclass(frozen=True, slots=True)
class ParamDecl:
    """`param wq: [heads * head_dim, hidden] from "model.layers.{i}.self_attn.q_proj.weight" if cond`."""

    name: str
    shape: tuple[Expr, ...]
    source: Str | None  # checkpoint tensor name template; `{i}` is the layer index inside a block
    cond: Expr | None  # the param exists only when this config expression is true
    loc: Loc
    fallback: Str | None = None  # `from "a" else "b"`: read b when the checkpoint has no a
    offset: float = 0.0  # `from "a" + 1.0`: added to the checkpoint tensor at weight conversion
    transposed: bool = False  # `from "a" transposed`: the checkpoint tensor's last two dims swapped at conversion


@dataclass(frozen=True, slots=True)
class BlockDecl:
    """`block decoder[layers] { params...; forward(h) {...} }`: one graph run `count` times."""

    name: str
    count: Expr
    params: tuple[ParamDecl, ...]
    forward: Forward
    loc: Loc


@dataclass(frozen=True, slots=True)
class ModelDecl:
    name: str
    config: tuple[ConfigParam, ...]
    params: tuple[ParamDecl, ...]  # top-level (non-block) params
    blocks: tuple[BlockDecl, ...]
    forward: Forward
    loc: Loc
    # named forwards, run by the runtime after the main one (a draft head: `forward mtp(tokens, hidden)`)
    forwards: tuple[Forward, ...] = ()


# ---------------------------------------------------------------- recipe declarations


@dataclass(frozen=True, slots=True)
class Setting:
    """`key = value` at recipe top level or inside a section."""

    key: str
    value: Expr
    loc: Loc


@dataclass(frozen=True, slots=True)
class PassHook:
    """`after fuse_qkv: "mypkg.mod:MyPass"` inside `passes { ... }`."""

    position: str  # after | before
    anchor: str
    spec: Str
    loc: Loc
    anchor_loc: Loc | None = field(default=None, compare=False)  # where the anchor pass's name is written


@dataclass(frozen=True, slots=True)
class Section:
    """`quantize { weights = fp8(block=128); kv_cache = fp8 }`."""

    name: str
    entries: tuple[Setting | PassHook, ...]
    loc: Loc


@dataclass(frozen=True, slots=True)
class RecipeDecl:
    name: str
    settings: tuple[Setting, ...]
    sections: tuple[Section, ...]
    loc: Loc


@dataclass(frozen=True, slots=True)
class UseDecl:
    """`use llama` (bundled model) or `use "path/to/file.dsl"` (relative to the using file)."""

    target: str
    is_path: bool
    loc: Loc


@dataclass(frozen=True, slots=True)
class Module:
    file: str
    uses: tuple[UseDecl, ...] = ()
    models: tuple[ModelDecl, ...] = ()
    recipes: tuple[RecipeDecl, ...] = ()
    loc: Loc | None = field(default=None)
