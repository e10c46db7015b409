#!/usr/bin/env bash
# Sets up the project venv (.venv/, scripts/venv.sh: the pinned CPU stack) and runs kiln's lint and test suite
# in it (what CI runs). Extra args go to pytest.
# pytest runs on KILN_TEST_WORKERS processes (pytest-xdist; default 2, the CI machine's cores; 0 = in this
# process): each test file runs whole on one worker, so module fixtures (servers, clusters, references) are
# built once; session fixtures once per worker.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m ruff check --quiet .
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
python -m pytest tests -n "${KILN_TEST_WORKERS:-2}" --dist loadfile "$@"
