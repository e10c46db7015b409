#!/usr/bin/env bash
# One prepared GPU session (~6 min): kiln's GPU tests, then the decode/prefill benchmark. Logs and JSON go
# under $OUT (default ./out); the summary table is printed last.
#
# Before the call, on the CPU machine:  bash /work/shared/wheels/stage.sh     (lark wheel -> .whl/)
# The call:   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to run here"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv || true

# The GPU image lacks lark: install the staged wheels, then kiln itself (editable, no deps).
if ! python3 -c "import lark" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "gpu_check: lark is missing and no .whl/ was carried (run /work/shared/wheels/stage.sh and carry .whl)"
        exit 2
    fi
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: pip install -e . failed"; exit 2; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
unset TRITON_INTERPRET

echo "== tests/gpu"
timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$OUT/tests_gpu.xml" 2>&1 | tee "$OUT/tests_gpu.log" | tail -25
tests_rc=${PIPESTATUS[0]}

echo "== benchmarks/gpu_decode.py"
timeout 230 python3 benchmarks/gpu_decode.py --out "$OUT" --budget-s 170 2>&1 | tee "$OUT/gpu_decode.log" | tail -30
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests/gpu rc=$tests_rc, benchmark rc=$bench_rc (124 = timed out); logs in $OUT"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
