"""kiln's processes run torch's OpenMP pool with idle threads asleep (runtime/threads.py), unless the user chose.

libgomp reports the policy it loaded with under OMP_DISPLAY_ENV=VERBOSE; GOMP_SPINCOUNT is 0 when idle threads
sleep at once and 300000 (its default) when they spin first."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _libgomp_settings(code: str, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return dict(re.findall(r"^\s+(\w+) = '([^']*)'", out.stderr, re.MULTILINE))


@pytest.mark.parametrize("code", [
    "import kiln.runtime, torch; torch.ones(8).sum()",  # LLM / LLMEngine in a user's script
    "import kiln.runtime.core.process, torch; torch.ones(8).sum()",  # the engine-core process's entry module
])
def test_idle_openmp_threads_sleep(code):
    settings = _libgomp_settings(code)
    assert settings["GOMP_SPINCOUNT"] == "0", settings


def test_a_policy_the_user_set_is_kept():
    settings = _libgomp_settings("import kiln.runtime, torch; torch.ones(8).sum()", OMP_WAIT_POLICY="ACTIVE")
    assert settings["OMP_WAIT_POLICY"] == "ACTIVE" and settings["GOMP_SPINCOUNT"] != "0", settings


def test_torch_imported_first_is_left_as_loaded():
    settings = _libgomp_settings("import torch, kiln.runtime; torch.ones(8).sum()")
    assert settings["GOMP_SPINCOUNT"] == "300000", settings
