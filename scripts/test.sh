#!/usr/bin/env bash
# Sets up the project venv (.venv/, scripts/venv.sh: the pinned CPU stack) and runs kiln's lint and test suite
# in it (what CI runs). Extra args go to pytest.
# KILN_TEST_WORKERS=N runs pytest on N pytest-xdist worker processes (default 0: in this process), each test file
# whole on one worker, so module fixtures (servers, clusters, references) are built once, session fixtures once
# per worker. Not the default yet: on a shared 2-core machine two workers failed the 100 ms /health bound of
# tests/server/test_server_hardening.py (a core timed by a fresh interpreter while the other worker computes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m ruff check --quiet .
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
python -m pytest tests -n "${KILN_TEST_WORKERS:-0}" --dist loadfile "$@"
