"""The pass API: `Pass`, `register_pass`, and the `PassManager` that runs, verifies and logs them.

This is kiln's public extension point. A custom pass is a `Pass` subclass with a `run(program, ctx)` that
returns a new `Program` (or the same object when nothing changed) and never mutates its input:

    @register_pass("my_pass", requires=("shape_inference",))
    class MyPass(Pass):
        '''Requires: typed IR. Guarantees: ...'''
        def run(self, program, ctx):
            ...

    pm = PassManager.for_target("cpu")          # the target's pipeline (kiln.passes registers kiln's own)
    pm.insert_after("fuse_qkv", MyPass())
"""
from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kiln.compiler.ir import Program
from kiln.compiler.text import print_program
from kiln.compiler.verifier import verify_program
from kiln.dsl.errors import KilnError


class PassError(KilnError):
    """A pass could not be found, ordered, or produced invalid IR."""


@dataclass
class PassContext:
    """What a pass may read besides the program, and where the manager records what passes did."""

    target: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)  # recipe sections (quantize, parallel, …)
    dump_dir: Path | None = None
    verify: bool = True
    log: list[PassRecord] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # a pass's own counters for this run, e.g. {"matches": 3}


@dataclass(frozen=True)
class PassRecord:
    name: str
    changed: bool
    nodes_before: int
    nodes_after: int
    params_before: int
    params_after: int
    seconds: float
    stats: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "changed": self.changed, "nodes": [self.nodes_before, self.nodes_after],
                "params": [self.params_before, self.params_after], "stats": self.stats}


class Pass:
    """A program-to-program transformation. `register_pass` sets its name and declared constraints."""

    name: str = "<unnamed>"
    requires: tuple[str, ...] = ()  # passes that must have run before this one (so must be in the pipeline)
    after: tuple[str, ...] = ()  # passes that, when in the pipeline, must run before this one
    before: tuple[str, ...] = ()  # passes that, when in the pipeline, must run after this one
    guarantees: tuple[str, ...] = ()  # properties of the IR from this pass on, e.g. "typed" (the verifier checks)

    def run(self, program: Program, ctx: PassContext) -> Program:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_REGISTRY: dict[str, type[Pass]] = {}
P = TypeVar("P", bound=type[Pass])


def register_pass(name: str, requires: Iterable[str] = (), *, after: Iterable[str] = (), before: Iterable[str] = (),
                  guarantees: Iterable[str] = ()) -> Callable[[P], P]:
    """Names a Pass class and declares where it may run: `requires` (must run before it), `after` / `before`
    (order relative to passes that may be absent). The pass manager checks them whenever a pipeline is built or
    edited, so a user's insert_before or disable cannot silently break an ordering a pass relies on."""
    def deco(cls: P) -> P:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise PassError(f"pass name {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name
        cls.requires, cls.after, cls.before = tuple(requires), tuple(after), tuple(before)
        cls.guarantees = tuple(guarantees)
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_passes() -> dict[str, type[Pass]]:
    return dict(_REGISTRY)


# pipeline name -> factory(target) -> the ordered passes; registered by the module that defines the passes
# (kiln.passes registers kiln's own), never imported here: a target names its pipeline and that module.
_PIPELINES: dict[str, Callable[[Any], list[Pass]]] = {}


def register_pipeline(name: str, factory: Callable[[Any], list[Pass]]) -> None:
    """Declares the pipeline `name`: `factory(target)` returns its passes in order (targets.Target names it)."""
    if name in _PIPELINES and _PIPELINES[name] is not factory:
        raise PassError(f"pipeline {name!r} is registered twice")
    _PIPELINES[name] = factory


def pipeline_passes(target: str) -> list[Pass]:
    """The passes of `target`'s pipeline: the target's `pipeline`, from the module it names (imported lazily)."""
    from kiln.compiler.targets import get_target

    tgt = get_target(target)
    if tgt.pipeline not in _PIPELINES:
        importlib.import_module(tgt.pipeline_module)  # registers its pipelines
    if tgt.pipeline not in _PIPELINES:
        raise PassError(f"target {target!r} names pipeline {tgt.pipeline!r}, which {tgt.pipeline_module} does not "
                        f"register (registered: {', '.join(sorted(_PIPELINES)) or 'none'})")
    return _PIPELINES[tgt.pipeline](tgt)


def check_order(passes: list[Pass]) -> None:
    """Raises PassError naming the passes when the list breaks a declared `requires`, `after` or `before`."""
    index: dict[str, int] = {}
    for k, p in enumerate(passes):
        index.setdefault(p.name, k)
    for k, p in enumerate(passes):
        for r in p.requires:
            if r not in index:
                raise PassError(f"pass {p.name!r} requires {r!r}, which is not in the pipeline")
            if index[r] > k:
                raise PassError(f"pass {p.name!r} requires {r!r} to run before it, but {r!r} comes after it")
        for a in p.after:
            if a in index and index[a] > k:
                raise PassError(f"pass {p.name!r} must run after {a!r} (declared by {p.name!r}), but {a!r} comes "
                                "after it")
        for b in p.before:
            if b in index and index[b] < k:
                raise PassError(f"pass {p.name!r} must run before {b!r} (declared by {p.name!r}), but {b!r} comes "
                                "before it")


def load_pass(spec: str, search: Iterable[str | Path] = ()) -> Pass:
    """Instantiates a pass from `"pkg.module:ClassName"` (recipe `passes { after X: "..." }`). The module is
    looked up in the `search` directories first (a recipe's own directory), then on sys.path. Importing it runs
    its code: a recipe's passes are code, as trusted as the recipe."""
    mod_name, _, attr = spec.partition(":")
    if not attr:
        raise PassError(f"pass spec {spec!r} must read 'package.module:ClassName'")
    dirs = [str(d) for d in search]
    saved = list(sys.path)
    sys.path[:0] = dirs
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        where = f" (looked in {', '.join(dirs)} and on sys.path)" if dirs else ""
        raise PassError(f"cannot import module {mod_name!r}{where}: {e}") from None
    except Exception as e:  # the module's own code failed
        raise PassError(f"importing {mod_name!r} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path[:] = saved
    cls = getattr(module, attr, None)
    if cls is None:
        raise PassError(f"module {mod_name!r} ({getattr(module, '__file__', '?')}) has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise PassError(f"{spec!r} is not a kiln Pass subclass")
    try:
        return cls()
    except Exception as e:
        raise PassError(f"{spec!r}(): {type(e).__name__}: {e}") from None


class PassManager:
    """An ordered list of passes. Runs each, verifies the IR after it, logs and optionally dumps it. Every edit
    is checked against the passes' declared constraints (`check_order`) and refused, unchanged, if it breaks one."""

    def __init__(self, passes: Iterable[Pass]):
        self.passes: list[Pass] = list(passes)
        check_order(self.passes)

    @classmethod
    def for_target(cls, target: str) -> PassManager:
        return cls(pipeline_passes(target))

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise PassError(f"no pass named {name!r} in the pipeline (have: {', '.join(self.names)})") from None

    def _edit(self, passes: list[Pass]) -> None:
        check_order(passes)
        self.passes = passes

    def insert_after(self, anchor: str, p: Pass) -> None:
        k = self._index(anchor) + 1
        self._edit([*self.passes[:k], p, *self.passes[k:]])

    def insert_before(self, anchor: str, p: Pass) -> None:
        k = self._index(anchor)
        self._edit([*self.passes[:k], p, *self.passes[k:]])

    def remove(self, name: str) -> None:
        k = self._index(name)
        needed = [p.name for p in self.passes if name in p.requires]
        if needed:
            raise PassError(f"cannot disable {name!r}: {', '.join(repr(n) for n in needed)} "
                            f"{'requires' if len(needed) == 1 else 'require'} it")
        self._edit(self.passes[:k] + self.passes[k + 1:])

    def run(self, program: Program, ctx: PassContext | None = None) -> Program:
        ctx = ctx or PassContext()
        done: set[str] = set()
        if ctx.verify:
            verify_program(program)
        if ctx.dump_dir is not None:
            ctx.dump_dir.mkdir(parents=True, exist_ok=True)
            (ctx.dump_dir / "00_input.ir").write_text(print_program(program))
        typed = False  # from the first pass that guarantees "typed" on, the verifier requires every type
        for k, p in enumerate(self.passes, start=1):
            missing = [r for r in p.requires if r not in done]
            if missing:
                raise PassError(f"pass {p.name!r} requires {missing} to run before it")
            typed = typed or "typed" in p.guarantees
            ctx.stats = {}
            t0 = time.perf_counter()
            out = p.run(program, ctx)
            dt = time.perf_counter() - t0
            if not isinstance(out, Program):
                raise PassError(f"pass {p.name!r} returned {type(out).__name__}, not a Program")
            if ctx.verify:
                try:
                    verify_program(out, require_types=typed)
                except Exception as e:
                    raise PassError(f"IR is invalid after pass {p.name!r}: {e}") from None
            ctx.log.append(PassRecord(p.name, out is not program, program.num_nodes(), out.num_nodes(),
                                      len(program.params), len(out.params), dt, dict(ctx.stats)))
            if ctx.dump_dir is not None:
                (ctx.dump_dir / f"{k:02d}_{p.name}.ir").write_text(print_program(out))
            done.add(p.name)
            program = out
        return program
