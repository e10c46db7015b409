#!/usr/bin/env bash
# Sets up the project venv (.venv/, scripts/venv.sh: the pinned CPU stack) and runs kiln's lint and test suite
# in it (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m ruff check --quiet .
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
python -m pytest tests "$@"
