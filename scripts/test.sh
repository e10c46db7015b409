#!/usr/bin/env bash
# Sets up the CPU toolchain and runs kiln's test suite (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
python3 -m ruff check --quiet .
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
python3 -m pytest tests "$@"
