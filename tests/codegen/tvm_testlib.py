"""Imports the cpu target's kernel package (kernels/{cpu,tvm}.py + tvm_cpu/) for a shape, as an artifact has it."""
from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

from kiln.codegen.tvm_build import write_cpu_kernels

_ids = itertools.count()


def build_kernel_package(root: Path, *, head_dim: int, num_heads: int, num_kv_heads: int, block_size: int,
                         dtype: str = "float32",
                         kernels=("tvm.paged_attention", "tvm.add_rms_norm", "tvm.rms_norm", "tvm.silu_mul")):
    """Writes root/kernels/ for the shape and imports it as a fresh package; returns its `tvm` module (which
    forwards to the torch library for what it does not cover) and the build record."""
    params = {"target": "cpu", "head_dim": head_dim, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
              "block_size": block_size, "dtype": dtype}
    record = write_cpu_kernels(root / "kernels", params, kernels, kiln_version="0.0.test")
    return import_kernel_package(root / "kernels"), record


def import_kernel_package(kdir: Path):
    """kdir (a kernels/ folder) imported as a fresh package; returns its `tvm` module."""
    package = f"_kiln_tvm_test_{next(_ids)}"
    spec = importlib.util.spec_from_file_location(package, kdir / "__init__.py", submodule_search_locations=[str(kdir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.tvm")
