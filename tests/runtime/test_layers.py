"""The runtime laid out by process (issue 28), held by its source: what each layer may import (runtime_layers.py
says which layer a module is in and the rules), no import cycles, an API process free of torch, no private name
shared across modules or reached into from a front-end, files of a readable size, the engine's step as its
phases. Every check reads the tree itself, so a new file is checked too."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import runtime_layers as L

# Files allowed past MAX_LINES, with the reason.
MAX_LINES = 600
LONG_FILES: dict[str, str] = {}


@pytest.fixture(scope="module")
def modules() -> dict[str, L.Module]:
    return L.runtime_modules()


def test_every_module_has_a_layer(modules):
    assert {L.layer_of(n) for n in modules} >= {"shared", "facade", "api", "core", "worker", "ipc", "disagg-api",
                                                "disagg-core", "disagg-wire"}


def test_every_import_keeps_to_its_layer(modules):
    assert L.layer_violations(modules) == []


def test_no_import_cycles(modules):
    assert L.cycles(modules) == []


def test_the_api_process_imports_no_torch(modules):
    assert L.torch_in_api_process(modules) == []
    # what it reads is what the API server runs: the server, the core client, the router
    api = L.closure(modules, [n for n in modules if L.layer_of(n) in L.API_PROCESS])
    assert {"api.async_engine", "ipc.client", "disagg.router", "tokenizer", "sampling_params"} <= api


def test_no_private_name_is_imported_from_another_module(modules):
    assert L.private_imports(modules) == []


def test_files_stay_readable(modules):
    long = {n: len(m.source.splitlines()) for n, m in modules.items() if len(m.source.splitlines()) > MAX_LINES}
    assert set(long) <= set(LONG_FILES), long


# ---------------------------------------------------------------- the rules fail on what they forbid


def _modules(files: dict[str, str]) -> dict[str, L.Module]:
    known = set(files)
    return {n: L.parse_module(n, src, known) for n, src in files.items()}


def test_a_planted_violation_in_a_copy_of_the_tree_is_found(tmp_path):
    tree = tmp_path / "runtime"
    shutil.copytree(L.RUNTIME, tree, ignore=shutil.ignore_patterns("__pycache__"))
    engine = tree / "core" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _planted():\n    from ..api import async_engine\n")
    runner = tree / "worker" / "model_runner.py"
    runner.write_text(runner.read_text() + "\nfrom ..core.scheduler import Scheduler\n")
    found = sorted(set(L.layer_violations(L.runtime_modules(tree))) - set(L.layer_violations(L.runtime_modules())))
    assert any(v.startswith("runtime/core/engine.py:") and "core imports api.async_engine (api) lazily" in v
               for v in found), found
    assert any(v.startswith("runtime/worker/model_runner.py:") and "worker imports core.scheduler" in v
               for v in found), found
    assert len(found) == 2, found


def test_the_rules_on_a_synthetic_graph():
    files = {"api.x": "def f():\n    from ..core import engine\n", "core.engine": "from ..api import x\n",
             "core.batch": "", "worker.w": "from ..core.batch import B\nfrom ..core.engine import E\n",
             "newmod": "from .api.x import f\n", "core.a": "def g():\n    from . import b\n",
             "core.b": "from .a import g\n", "__init__": "", "api.__init__": "", "core.__init__": "",
             "worker.__init__": ""}
    mods = _modules(files)
    found = L.layer_violations(mods)
    assert "runtime/api/x.py:2: api imports core.engine (core) lazily" in found
    assert "runtime/core/engine.py:1: core imports api.x (api)" in found
    assert "runtime/worker/w.py:2: worker imports core.engine (core)" in found  # core.batch on line 1 is allowed
    assert "runtime/newmod.py:1: shared imports api.x (api)" in found  # a new top-level module is shared
    assert len(found) == 4, found
    assert sorted(map(sorted, L.cycles(mods))) == [["api.x", "core.engine"], ["core.a", "core.b"]]
    with pytest.raises(KeyError, match="disagg/new.py: a disagg module no layer rule names"):
        L.layer_of("disagg.new")
    torch = _modules({"api.s": "def f():\n    import torch\n", "shared1": "def g():\n    import torch\n",
                      "shared2": "import torch.nn\n", "api.t": "from ..shared1 import g\nfrom ..shared2 import h\n"})
    assert L.torch_in_api_process(torch) == ["runtime/api/s.py:2: api imports torch",
                                             "runtime/shared2.py:1: shared imports torch"]
    assert L.private_imports(_modules({"a": "from .b import _c, d\n", "b": ""})) == ["runtime/a.py:1: imports _c"]


# ---------------------------------------------------------------- the front-ends and the core's private state


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _core_private(modules: dict[str, L.Module]) -> set[str]:
    names = set()
    for m in modules.values():
        if L.layer_of(m.name) not in ("core", "worker"):
            continue
        for node in ast.walk(ast.parse(m.source)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                names.add(node.attr)
    return names


def private_reads(source: str, core_private: set[str], inherited: set[str]) -> list[str]:
    """Where `source` reads a core private (`x._y`, x not self/cls; through self, one of the `inherited` ones)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls") and node.attr in core_private:
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif owner in ("self", "cls") and node.attr in inherited:
                out.append(f"line {node.lineno}: {ast.unparse(node)} (EngineCore's private state)")
    return out


def test_front_ends_read_no_private_state_of_the_core(modules):
    core_private = _core_private(modules)
    assert {"_inflight", "_pending", "_isolate", "_commit", "_swap_ids"} <= core_private  # the scan sees them
    engine_private = {n for n in core_private if n in modules["core.engine"].source}
    found = {}
    for m in modules.values():
        if L.layer_of(m.name) in ("api", "ipc", "facade", "disagg-api"):
            # llm_engine subclasses EngineCore: its own private attributes are its own, the core's are not
            bad = private_reads(m.source, core_private, engine_private if m.name == "llm_engine" else set())
            if bad:
                found[m.name] = bad
    assert found == {}


def test_the_private_state_check_catches_what_it_forbids():
    core = {"_take_pending", "_inflight"}
    assert private_reads("def f(engine):\n    return engine._inflight\n", core, set()) == ["line 2: engine._inflight"]
    assert private_reads("def f(p):\n    return p._segments\n", core, set()) == []  # not the core's
    assert private_reads("class E:\n    def f(self):\n        self._take_pending()\n", core, core) == [
        "line 3: self._take_pending (EngineCore's private state)"]
    assert private_reads("class E:\n    def f(self):\n        return self._own\n", core, core) == []


def test_engine_reads_as_its_phases():
    source = (L.RUNTIME / "core" / "engine.py").read_text()
    assert len(source.splitlines()) <= 300
    tree = ast.parse(source)

    def body(name: str) -> str:
        return ast.get_source_segment(source, next(n for n in ast.walk(tree)
                                                   if isinstance(n, ast.FunctionDef) and n.name == name))
    # schedule -> execute -> sample -> update, in that order, in step() and the calls it makes
    step = body("step")
    assert step.index("self.scheduler.schedule()") < step.index("self._step_sync(")
    sync = body("_step_sync")
    assert sync.index("self._launch(") < sync.index("self._commit(")
    launch = body("_launch")
    assert launch.index("self.runner.execute(") < launch.index("self.sampler.sample(")


def test_module_paths_resolve():
    assert Path(L.RUNTIME / "core" / "engine.py").is_file() and (L.RUNTIME / "api").is_dir()


def test_the_package_exports_resolve():
    import kiln.runtime as runtime

    assert set(runtime._LAZY) <= set(runtime.__all__)
    for name in runtime.__all__:
        assert getattr(runtime, name).__name__ == name
