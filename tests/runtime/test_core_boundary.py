"""The boundary between the engine core and its front-ends (issue 11): the API server and the in-process LLM
use the core through its public names and the protocol only; runtime/core/engine.py stays one screenful of phases."""
from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

# The engine core: what runs in the engine-core process (core/process.py) behind the protocol.
CORE = {"core/engine", "core/scheduler", "core/kv_cache", "worker/model_runner", "core/sampler", "core/speculative",
        "core/overlap", "worker/memory_plan", "core/process", "core/sequence", "core/prefix_cache",
        "worker/graph_runner", "forward_batch", "core/stops", "threads"}
# The front-ends: the API server process, and the in-process LLM / LLMEngine over the same core.
FRONT_END = ["api/app", "api/serving", "api/middleware", "api/streaming", "api/formatters", "launch",
             "api/async_engine", "ipc/client", "api/output_processor", "entrypoint", "api/protocol", "api/metrics",
             "tokenizer", "llm", "llm_engine", "api/tool_parsers", "api/reasoning_parsers", "outputs"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees(module: str) -> list[ast.Module]:
    """A runtime module's syntax tree; a package's (runtime/core/speculative/): each of its files'."""
    path = RUNTIME / f"{module}.py"
    files = [path] if path.exists() else sorted((RUNTIME / module).glob("*.py"))
    return [ast.parse(f.read_text()) for f in files]


def _private_members(module: str) -> set[str]:
    """Private names a runtime module defines: functions, methods, classes, module globals, `self._x` attributes."""
    names = set()
    for node in (n for tree in _trees(module) for n in ast.walk(tree)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
    return names


def violations(source: str, core_private: set[str], inherited: set[str]) -> list[str]:
    """Where `source` imports a private name of a core module, or reads a core private (`x._y`, `_y` one of
    `core_private`, x not self/cls; or through self, `_y` one of the `inherited` EngineCore privates)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[-1]
            if module in {c.split("/")[-1] for c in CORE}:
                out += [f"line {node.lineno}: from {'.' * node.level}{node.module} import {a.name}"
                        for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls") and node.attr in core_private:
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif owner in ("self", "cls") and node.attr in inherited:
                out.append(f"line {node.lineno}: {ast.unparse(node)} (EngineCore's private state)")
    return out


def test_front_end_uses_no_private_name_of_the_core():
    engine_private = _private_members("core/engine")
    core_private = set().union(*(_private_members(m) for m in CORE))
    assert {"_inflight", "_pending", "_isolate", "_commit", "_swap_ids"} <= core_private  # the scan sees them
    found = {}
    for name in FRONT_END:
        source = (RUNTIME / f"{name}.py").read_text()
        # llm_engine subclasses EngineCore: its own private attributes are its own, the core's are not
        bad = violations(source, core_private, engine_private if name == "llm_engine" else set())
        if bad:
            found[name] = bad
    assert found == {}


def test_the_check_catches_what_it_forbids():
    core = {"_take_pending", "_inflight"}
    assert violations("from .engine import _UNSET\n", core, set()) == ["line 1: from .engine import _UNSET"]
    assert violations("def f(engine):\n    return engine._inflight\n", core, set()) == ["line 2: engine._inflight"]
    assert violations("def f(p):\n    return p._segments\n", core, set()) == []  # not the core's
    assert violations("class E:\n    def f(self):\n        self._take_pending()\n", core, core) == [
        "line 3: self._take_pending (EngineCore's private state)"]
    assert violations("class E:\n    def f(self):\n        return self._own\n", core, core) == []
    assert violations("from .engine import EngineCore\n", core, set()) == []


def test_engine_reads_as_its_phases():
    source = (RUNTIME / "core" / "engine.py").read_text()
    assert len(source.splitlines()) <= 300
    step = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "step")
    text = ast.get_source_segment(source, step)
    # schedule -> execute -> sample -> update, in that order, in step() and the calls it makes
    assert text.index("self.scheduler.schedule()") < text.index("self._step_sync(")
    sync = ast.get_source_segment(source, next(n for n in ast.walk(ast.parse(source))
                                               if isinstance(n, ast.FunctionDef) and n.name == "_step_sync"))
    assert sync.index("self._launch(") < sync.index("self._commit(")
    launch = ast.get_source_segment(source, next(n for n in ast.walk(ast.parse(source))
                                                 if isinstance(n, ast.FunctionDef) and n.name == "_launch"))
    assert launch.index("self.runner.execute(") < launch.index("self.sampler.sample(")
