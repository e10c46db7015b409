"""A compiled artifact needs only the runtime (issue 11, item 3): `python ARTIFACT generate` runs with the
compiler's packages (lark, networkx, jinja2, apache-tvm's `tvm`) made unimportable, and its TVM CPU kernels
still load, through tvm-ffi and TVM's runtime library (found in the installed apache-tvm, never imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import kiln

BLOCKED = ("lark", "networkx", "jinja2", "tvm")

# sitecustomize of the subprocess: a meta-path finder placed first. A blocked package can still be *found*
# (importlib.util.find_spec: where its files are), but importing it raises ImportError, and every attempt is
# written to the KILN_BLOCKED_LOG file so a runtime that catches the ImportError is caught anyway.
SITECUSTOMIZE = textwrap.dedent('''\
    import importlib.abc, importlib.machinery, os, sys
    BLOCKED = set(os.environ["KILN_BLOCKED"].split(","))

    class _Refuse(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            with open(os.environ["KILN_BLOCKED_LOG"], "a") as f:
                f.write(module.__name__ + "\\n")
            raise ImportError(f"{module.__name__} is blocked in this test (the runtime must not need it)")

    class _Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in BLOCKED:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = _Refuse()
            return spec

    sys.meta_path.insert(0, _Blocker())
    ''')

MODEL = "llama(vocab=96, hidden=64, layers=2, heads=2, kv_heads=1, ffn=128, max_position=256)"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    work = tmp_path_factory.mktemp("runtime-only")
    recipe = work / "r.dsl"
    recipe.write_text(f"recipe r {{\n  model   = {MODEL}\n  weights = random(seed=0)\n  target  = cpu\n}}\n")
    kiln.compile(recipe, work / "art", progress=False)
    return work / "art"


def _blocked_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "blocked.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "KILN_BLOCKED": ",".join(BLOCKED), "KILN_BLOCKED_LOG": str(log)}
    return env, log


def test_the_blocker_blocks(tmp_path):
    env, log = _blocked_env(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import importlib.util as u; assert u.find_spec('tvm'); import lark"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "lark is blocked" in r.stderr
    assert log.read_text().split() == ["lark"]


def test_artifact_generates_without_the_compiler(artifact, tmp_path):
    want = kiln.LLM(str(artifact)).generate(
        [[1, 2, 3]], kiln.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    env, log = _blocked_env(tmp_path)
    r = subprocess.run([sys.executable, str(artifact), "generate", "1 2 3", "--token-ids", "--max-tokens", "6",
                        "--ignore-eos"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [int(t) for t in r.stdout.split()] == want
    assert not log.exists(), f"the artifact tried to import {log.read_text().split()}"
    assert "using torch kernels" not in r.stderr, r.stderr


def test_tvm_kernels_load_without_the_tvm_package(artifact, tmp_path):
    record = json.loads((artifact / "kernels" / "tvm_cpu" / "build.json").read_text())
    if not record.get("library"):
        pytest.skip(f"this host built no TVM library: {record.get('reason')}")
    env, log = _blocked_env(tmp_path)
    code = textwrap.dedent(f"""\
        import sys
        from kiln.runtime import tvm_kernels
        lib = tvm_kernels.load_library({str(artifact / "kernels" / "tvm_cpu")!r})
        assert lib is not None and lib.functions, "the TVM kernels did not load"
        assert "tvm" not in sys.modules
        print(sorted(lib.functions))
        """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not log.exists(), f"loading the kernels tried to import {log.read_text().split()}"
    assert set(eval(r.stdout)) == set(record["functions"])
