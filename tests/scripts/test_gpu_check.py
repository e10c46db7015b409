"""scripts/gpu_check.sh leaves at most 8 files under $OUT (what the GPU runner brings back), logs in one tarball.

Run on this CPU machine with a stand-in `python3` that claims CUDA and plays each step (writes the junit XML or
the benchmark's JSON where the real step does); the summary runs on the real interpreter."""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STANDIN = """#!/bin/sh
case "$1 $2" in
  "- "*|"- ") exec "{real}" "$@" ;;
  "-m pytest") for a in "$@"; do case "$a" in --junitxml=*) f=${{a#--junitxml=}};
      echo '<testsuite tests="3" failures="0" errors="0" skipped="1"><testcase classname="t" name="a"/></testsuite>' > "$f";; esac; done
      echo "3 passed"; exit 0 ;;
  "-m pip") exit 0 ;;
esac
case "$1" in
  benchmarks/*.py) name=$(basename "$1" .py); out=$3; echo '{{}}' > "$out/$name.json"; echo "$name ran"; exit 0 ;;
  -c) exit 0 ;;
esac
exec "{real}" "$@"
"""


def test_gpu_check_writes_at_most_eight_files(tmp_path, standin_python3):
    bin_dir = standin_python3(STANDIN.format(real=sys.executable))
    out = tmp_path / "out"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "HOME": str(tmp_path)}
    res = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["gpu_check.log", "gpu_decode.json", "gpu_deepseek_layer.json", "gpu_engine.json",
                     "logs.tar.gz", "tests_gpu.xml"]
    assert len(files) <= 8
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert sorted(logs) == ["decode.log", "deepseek.log", "engine.log", "tests.log"]
    assert "3 passed" in logs["tests.log"] and "gpu_decode ran" in logs["decode.log"]
    assert "tests/gpu: 2 passed, 0 failed, 0 errors, 1 skipped" in (out / "gpu_check.log").read_text()
