"""scripts/venv.sh (sourced by scripts/test.sh and scripts/demo.sh) installs into the project venv, never into
the `python3` on PATH: here that python3 refuses pip as Debian's externally-managed system Python does.

The full path, from no venv at all on Debian's system Python 3.11, is checked by hand (README, Quick start)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON3 = """#!/bin/sh
echo "$@" >> "{log}"
case "$*" in
  *"-m pip"*) echo "error: externally-managed-environment" >&2; exit 1 ;;
  *"-m venv"*) echo "python3 -m venv must not run: the venv exists" >&2; exit 1 ;;
esac
exec "{real}" "$@"
"""


def test_venv_script_never_installs_into_the_system_python(tmp_path, standin_python3):
    log = tmp_path / "python3.log"
    bin_dir = standin_python3(FAKE_PYTHON3.format(log=log, real=sys.executable))
    venv = Path(sys.prefix)  # the venv this test runs in stands for an existing project venv
    script = 'source scripts/venv.sh >/dev/null && command -v python && python -c "import sys; print(sys.prefix)"'
    env = {"HOME": os.environ.get("HOME", str(tmp_path)), "PATH": f"{bin_dir}:/usr/bin:/bin",
           "KILN_VENV": str(venv), "PIP_REQUIRE_VIRTUALENV": "1",
           **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    python, prefix = res.stdout.split()
    assert Path(python) == venv / "bin" / "python" and Path(prefix) == venv
    assert not log.exists() or "-m pip" not in log.read_text()


def test_venv_script_reports_a_missing_venv_module(tmp_path, standin_python3):
    """No venv module (Debian without python3-venv): a clear message naming the package, and no half venv."""
    bin_dir = standin_python3("#!/bin/sh\necho 'The virtual environment was not created successfully because "
                              "ensurepip is not available.' >&2\nexit 1\n")
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin", "KILN_VENV": str(tmp_path / "venv")}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", "source scripts/venv.sh"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "apt install python3-venv" in res.stderr
    assert not (tmp_path / "venv").exists()
