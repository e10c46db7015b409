"""Shared by the MLA tests: the rendered CPU kernel library."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import jinja2
import pytest

TEMPLATES = Path(__file__).resolve().parents[2] / "codegen" / "templates"


@pytest.fixture(scope="session")
def K(tmp_path_factory):
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    path = tmp_path_factory.mktemp("mla_kernels") / "cpu_kernels.py"
    path.write_text(env.get_template("cpu/kernels.py.j2").render(kiln_version="0.0.test"))
    spec = importlib.util.spec_from_file_location("kiln_test_mla_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
