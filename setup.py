"""The package list, found from the tree: every folder with an `__init__.py` under the folders that map to kiln's
packages (dsl/ -> kiln.dsl, ...), so a new package directory ships without a line here. The metadata, the
dependencies and the package data are pyproject.toml's; tests/facade/test_wheel.py checks the wheel against the
tree."""
from __future__ import annotations

import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# kiln's top-level packages and the repository folders they are (setuptools wants the paths relative to ROOT)
PACKAGE_DIR = {"kiln": "kiln", "kiln.dsl": "dsl", "kiln.compiler": "compiler", "kiln.passes": "passes",
               "kiln.codegen": "codegen", "kiln.runtime": "runtime", "kiln.models": "models"}


def find_packages() -> list[str]:
    """Each mapped folder and every folder below it that has an `__init__.py` (whose parents all have one: a
    folder under a plain data folder is data, not a package)."""
    packages = []
    for name, folder in PACKAGE_DIR.items():
        top = os.path.join(ROOT, folder)
        for here, dirs, files in os.walk(top):
            if "__init__.py" not in files:
                dirs.clear()  # not a package: nothing under it is one either
                continue
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(here, top)
            packages.append(name if rel == "." else ".".join([name, *rel.split(os.sep)]))
    return packages


setup(packages=find_packages(), package_dir=PACKAGE_DIR)
