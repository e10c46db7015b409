"""The runtime's layers and what each may import, read from the source (no module is imported).

A module's layer is its folder under runtime/ (api, core, worker, ipc), its role inside disagg/ (the wire types
both sides read, the core side's plugins, the router's side), or, at the top level, `shared` — except the
facades, which compose the layers (LLM, LLMEngine, the command lines, the server's launch). A new file lands in
the strictest rule of its place: a new top-level module is `shared`, a new disagg/ module must be classified.
Every import counts, lazy ones (inside functions) included; only `if TYPE_CHECKING:` blocks are skipped.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
PACKAGE = "kiln.runtime"

FACADES = {"__init__", "llm", "llm_engine", "entrypoint", "launch", "disagg.remote"}
DISAGG = {"disagg.__init__": "disagg-wire", "disagg.transport": "disagg-wire",
          "disagg.nixl_transport": "disagg-core", "disagg.roles": "disagg-core", "disagg.plugins": "disagg-core",
          "disagg.service": "disagg-api", "disagg.router": "disagg-api"}
# layer -> the layers (or single modules) it may import
ALLOWED = {
    "shared": {"shared", "ipc.protocol"},
    "ipc": {"shared", "ipc"},
    "api": {"shared", "ipc", "api"},
    "core": {"shared", "ipc", "core", "worker"},
    "worker": {"shared", "worker", "core.batch", "core.sequence"},
    "disagg-wire": {"shared", "ipc", "disagg-wire"},
    "disagg-core": {"shared", "ipc", "core", "worker", "disagg-wire", "disagg-core"},
    "disagg-api": {"shared", "ipc", "api", "disagg-wire", "disagg-api"},
}
# The API server and the router never load torch. Their own layers may not import it anywhere (every function
# of theirs runs there); the shared modules and the wire types they import may not at module level (a shared
# module's function the core alone calls may).
API_PROCESS = ("api", "ipc", "disagg-api")
API_READS = ("shared", "disagg-wire")


def layer_of(module: str) -> str:
    """`module` relative to kiln.runtime, dotted, a package as `pkg.__init__`."""
    if module in FACADES:
        return "facade"
    top = module.split(".")[0]
    if top == "disagg":
        if module not in DISAGG:
            raise KeyError(f"runtime/{module.replace('.', '/')}.py: a disagg module no layer rule names; add it "
                           "to DISAGG in tests/runtime/runtime_layers.py")
        return DISAGG[module]
    if "." not in module:
        return "shared"
    if top in ("api", "core", "worker", "ipc"):
        return top
    raise KeyError(f"runtime/{module.replace('.', '/')}.py: in a folder no layer rule names")


@dataclass
class Module:
    name: str  # relative to kiln.runtime
    path: Path
    imports: list[tuple[str, int, bool]] = field(default_factory=list)  # (kiln.runtime module, line, lazy)
    external: set[str] = field(default_factory=set)  # top-level names of other packages it imports
    source: str = ""


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def parse_module(name: str, source: str, known: set[str], path: Path = Path()) -> Module:
    """The runtime imports of module `name` (relative to kiln.runtime), resolved against the `known` modules:
    `from .x import y` is module x.y when that is a module, else x."""
    tree = ast.parse(source)
    mod = Module(name, path, source=source)
    skip = _type_checking_nodes(tree)
    top = {id(n) for n in tree.body}
    is_pkg = name.endswith("__init__")
    parts = name.split(".")[:-1]  # the module's package, relative
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        lazy = id(node) not in top
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    targets.append(alias.name[len(PACKAGE) + 1:])
                elif alias.name != PACKAGE:
                    mod.external.add(alias.name.split(".")[0])
            names: list[str] = []
        else:
            if node.level:
                base = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                if node.level - 1 > len(parts):
                    continue  # above kiln.runtime: the compiler or kiln itself
                base_mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                base_mod = node.module[len(PACKAGE) + 1:]
            else:
                if node.module:
                    mod.external.add(node.module.split(".")[0])
                continue
            names = [a.name for a in node.names]
            subs = [f"{base_mod}.{n}".lstrip(".") for n in names]
            found = [s for s in subs if s in known or f"{s}.__init__" in known]
            targets += found or [base_mod]
            if found and len(found) < len(names):
                targets.append(base_mod)
        for t in targets:
            t = t if t in known else (f"{t}.__init__" if f"{t}.__init__" in known else t)
            if t == "" or t == ".":
                t = "__init__"
            mod.imports.append((t, node.lineno, lazy))
    del is_pkg
    return mod


def runtime_modules(root: Path = RUNTIME) -> dict[str, Module]:
    files = sorted(root.rglob("*.py"))
    names = {".".join(f.relative_to(root).with_suffix("").parts): f for f in files}
    known = set(names)
    return {n: parse_module(n, f.read_text(), known, f) for n, f in names.items()}


def _allowed(src_layer: str, target: str) -> bool:
    rules = ALLOWED[src_layer]
    tgt = target.removesuffix(".__init__")
    return layer_of(target) in rules or tgt in rules


def layer_violations(modules: dict[str, Module]) -> list[str]:
    out = []
    for m in modules.values():
        src = layer_of(m.name)
        if src == "facade":
            continue
        for target, line, lazy in m.imports:
            if target not in modules or target == m.name:
                continue
            if not _allowed(src, target):
                out.append(f"runtime/{m.name.replace('.', '/')}.py:{line}: {src} imports {target} "
                           f"({layer_of(target)}){' lazily' if lazy else ''}")
    return out


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Import cycles among the runtime's modules (lazy imports included), each once, as a path."""
    graph = {n: sorted({t for t, _, _ in m.imports if t in modules and t != n}) for n, m in modules.items()}
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ importing its own submodules is how a package exports: not a cycle of layers
    return [c for c in out if not all(x.split(".")[0] == c[0].split(".")[0] and
                                      any(y.endswith("__init__") for y in c) for x in c)]


def closure(modules: dict[str, Module], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n in seen or n not in modules:
            continue
        seen.add(n)
        todo += [t for t, _, _ in modules[n].imports]
    return seen


def torch_in_api_process(modules: dict[str, Module]) -> list[str]:
    """Where the API process's modules (its layers and all they import) import torch."""
    roots = [n for n in modules if layer_of(n) in API_PROCESS]
    out = []
    for n in sorted(closure(modules, roots)):
        layer = layer_of(n)
        for node in ast.walk(ast.parse(modules[n].source)) if layer in API_PROCESS else ast.parse(modules[n].source).body:
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
                out.append(f"runtime/{n.replace('.', '/')}.py:{node.lineno}: {layer} imports torch")
    return out


def private_imports(modules: dict[str, Module]) -> list[str]:
    """`from .x import _y` of another runtime module's private name (what is shared is public)."""
    out = []
    for m in modules.values():
        tree = ast.parse(m.source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"runtime/{m.name.replace('.', '/')}.py:{node.lineno}: imports {a.name}")
    return out
