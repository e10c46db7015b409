"""MoE test fixtures: the rendered CPU kernel library as a module."""
from __future__ import annotations

import importlib.util

import pytest
from kiln.codegen.render import template_env


@pytest.fixture(scope="session")
def K(tmp_path_factory):
    source = template_env().get_template("cpu/kernels.py.j2").render(kiln_version="0.0.test")
    path = tmp_path_factory.mktemp("moe_kernels") / "cpu_kernels.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kiln_moe_test_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
