"""Loads DSL files from disk, resolves `use` and bundled models, and returns only checked input."""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from kiln.dsl import ast
from kiln.dsl.check import check_module, check_recipe
from kiln.dsl.errors import Loc, SourceError
from kiln.dsl.evaluate import Value
from kiln.dsl.parser import parse


@dataclass(frozen=True)
class LoadedRecipe:
    """A checked recipe, every model visible to it, and its model's instantiated config."""

    recipe: ast.RecipeDecl
    models: dict[str, ast.ModelDecl]
    file: str
    config: dict[str, Value] = field(default_factory=dict)

    @property
    def model_call(self) -> ast.Call:
        """The recipe's `model = NAME(...)` call (the loader guarantees it is one)."""
        return next(s.value for s in self.recipe.settings if s.key == "model")

    @property
    def model(self) -> ast.ModelDecl:
        return self.models[self.model_call.func]


def bundled_models_dir() -> Path:
    """The folder of the bundled `*.dsl` models (the `kiln.models` package)."""
    import kiln.models

    return Path(kiln.models.__file__).parent


def bundled_model_names() -> list[str]:
    return sorted(p.stem for p in bundled_models_dir().glob("*.dsl"))


def load_file(path: str | os.PathLike) -> ast.Module:
    """Parses one file and checks its models. Its recipes are checked by `load_recipe`."""
    file = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SourceError(f"cannot read {file}: {e.strerror or e}", None) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SourceError(f"not UTF-8 text: byte 0x{data[e.start]:02x} ({e.reason}); save the file as UTF-8",
                          Loc(file, line, col, col + 1)) from None
    module = parse(text, file)
    check_module(module)
    return module


def load_recipe(path: str | os.PathLike, name: str | None = None) -> LoadedRecipe:
    """Loads the recipe `name` (or the file's only recipe) with every model it can see: the file's own,
    those of files it `use`s, and the bundled `NAME.dsl` of its `model = NAME(...)` if still unknown."""
    module = load_file(path)
    recipe = _pick_recipe(module, name)
    models: dict[str, ast.ModelDecl] = {}
    _collect(module, models, {_key(module.file)})
    call = next((s.value for s in recipe.settings if s.key == "model"), None)
    if isinstance(call, ast.Call) and call.func not in models:
        bundled = bundled_models_dir() / f"{call.func}.dsl"
        if bundled.is_file() and _key(str(bundled)) != _key(module.file):
            _collect(load_file(bundled), models, {_key(module.file), _key(str(bundled))})
    config = check_recipe(recipe, models)
    return LoadedRecipe(recipe, models, module.file, config)


def _pick_recipe(module: ast.Module, name: str | None) -> ast.RecipeDecl:
    recipes = {r.name: r for r in module.recipes}
    start = Loc(module.file, 1, 1)
    if name is not None:
        if name not in recipes:
            raise SourceError(f"no recipe '{name}' in {module.file}", start,
                              (f"recipes in this file: {', '.join(recipes) or 'none'}",))
        return recipes[name]
    if not recipes:
        raise SourceError(f"{module.file} declares no recipe", start)
    if len(recipes) > 1:
        raise SourceError(f"{module.file} declares {len(recipes)} recipes; name the one to use",
                          module.recipes[1].loc, (f"recipes in this file: {', '.join(recipes)}",))
    return module.recipes[0]


def _key(file: str) -> str:
    return os.path.realpath(file)


def _collect(module: ast.Module, models: dict[str, ast.ModelDecl], seen: set[str]) -> None:
    """Adds `module`'s models and, transitively, those of the files it uses (each file once)."""
    for m in module.models:
        first = models.get(m.name)
        if first is not None and first is not m:
            raise SourceError(f"model '{m.name}' is declared twice", m.loc,
                              (f"the first declaration is at {first.loc}",))
        models[m.name] = m
    for use in module.uses:
        target = _resolve_use(use, module.file)
        if _key(target) in seen:
            continue
        seen.add(_key(target))
        _collect(load_file(target), models, seen)


def _resolve_use(use: ast.UseDecl, using_file: str) -> str:
    if use.is_path:
        target = os.path.normpath(os.path.join(os.path.dirname(using_file), use.target))
        if not os.path.isfile(target):
            raise SourceError(f"cannot find '{use.target}' (looked for {target})", use.loc)
        return target
    target = bundled_models_dir() / f"{use.target}.dsl"
    if not target.is_file():
        names = bundled_model_names()
        close = difflib.get_close_matches(use.target, names, n=1)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        raise SourceError(f"no bundled model '{use.target}'{hint}", use.loc,
                          (f"bundled models: {', '.join(names) or 'none'}",))
    return str(target)
