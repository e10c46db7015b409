#!/usr/bin/env bash
# One prepared GPU session, at most ~9.5 minutes on an H200: kiln's GPU tests, then the benchmarks —
# decode/prefill vs hardware limits (gpu_decode.py, with 8B fp8/int4 variants), the real engine in steady
# decode with its memory plan (gpu_engine.py), one DeepSeek-V3-shaped layer vs its bytes limit
# (gpu_deepseek_layer.py). Each step runs under its own `timeout` (tests 190 s, decode 220 s, engine 70 s,
# deepseek 60 s: 540 s + ~25 s of setup; autotuning's first-call timing included), writes its JSON under $OUT
# (default ./out) and its log into $OUT/logs.tar.gz as it goes, so a step that runs out of time still leaves
# what it measured; a summary table is printed last. $OUT holds at most 6 files (the GPU runner brings back
# 8): gpu_check.log, logs.tar.gz (tests.log, decode.log, engine.log, deepseek.log), tests_gpu.xml,
# gpu_decode.json, gpu_engine.json, gpu_deepseek_layer.json. A session has
# ~15 min of device time including start-up: this is meant to be ONE call; rerun a failed step with STEPS=.
#
# Before the call, on the CPU machine:  bash /work/shared/wheels/stage.sh     (lark wheel -> .whl/)
# The call:   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
# One step alone:   STEPS="engine deepseek" bash scripts/gpu_check.sh      (names: tests decode engine deepseek)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
STEPS=${STEPS:-"tests decode engine deepseek"}
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

declare -A RC SECS
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
# step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout LIMIT_S` with SIGINT (pytest then still prints its
# summary and writes the junit XML of what ran; SIGKILL 10 s later); its log NAME.log goes into
# $OUT/logs.tar.gz, rewritten after every step
step() {
    local name=$1 limit=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) RC[$name]=skipped; SECS[$name]=0; return ;; esac
    echo "== $name ($*; limit ${limit}s)"
    local t0=$SECONDS
    timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | tail -40
    RC[$name]=${PIPESTATUS[0]}
    SECS[$name]=$((SECONDS - t0))
    tar -czf "$OUT/logs.tar.gz.tmp" -C "$LOGS" . && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

step tests 190 python3 -m pytest tests/gpu -q -p no:cacheprovider --durations=15 --junitxml="$OUT/tests_gpu.xml"
step decode 220 python3 benchmarks/gpu_decode.py --out "$OUT" --budget-s 90 --quant fp8,int4 --quant-budget-s 60
step engine 70 python3 benchmarks/gpu_engine.py --out "$OUT" --budget-s 50
step deepseek 60 python3 benchmarks/gpu_deepseek_layer.py --out "$OUT" --budget-s 40

# Summary: each step's outcome, then the headline figures from the JSON the benchmarks wrote.
echo
echo "gpu_check summary (rc 124/137 = hit its timeout; ${SECONDS}s in all; JSON and logs.tar.gz in $OUT)"
printf '  %-9s %8s %6s\n' step rc seconds
for s in tests decode engine deepseek; do printf '  %-9s %8s %6s\n' "$s" "${RC[$s]}" "${SECS[$s]}"; done
OUT="$OUT" python3 - <<'EOF' || true
import json, os
from pathlib import Path

out = Path(os.environ["OUT"])

def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None

junit = out / "tests_gpu.xml"
if junit.is_file():
    import xml.etree.ElementTree as ET

    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, sk = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    print(f"\n  tests/gpu: {n - f - e - sk} passed, {f} failed, {e} errors, {sk} skipped")
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"    FAILED {case.get('classname')}::{case.get('name')}")
d = load("gpu_decode.json")
if d:
    print("\n  decode (gpu_decode.json): model, batch, eager ms, CUDA-graph ms, share of the streaming limit (graph)")
    for name, r in d.get("models", {}).items():
        for row in r.get("decode", []):
            g = row.get("graph_step_s")
            share = f"{row['limit_s'] / g:.0%}" if g else "-"
            graph = f"{g * 1e3:.3f}" if g else "-"
            print(f"    {name:15s} {row['batch']:4d} {row['step_s'] * 1e3:9.3f} {graph:>9} {share:>6}")
    q = d.get("quantized", {})
    if q:
        print("\n  quantized 8B decode (gpu_decode.json): scheme, batch, ms (graph if captured), share of its limit, "
              "tokens/s vs bf16 (bars: fp8 >= 1.8x, int4 >= 2.5x at batch 1)")
        for scheme, r in q.items():
            if scheme == "kv_capacity" or not isinstance(r, dict):
                continue
            for row in r.get("decode", []):
                t = row.get("graph_step_s") or row["step_s"]
                sp = f"{row['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in row else "-"
                print(f"    {scheme:15s} {row['batch']:4d} {t * 1e3:9.3f} {row['limit_s'] / t:6.0%} {sp:>7}")
            if "error" in r:
                print(f"    {scheme:15s} ERROR {r['error']}")
        cap = q.get("kv_capacity", {})
        if "ratio" in cap:
            print(f"    fp8 KV holds {cap['ratio']:.2f}x the bf16 KV tokens in the same memory (bar >= 1.9x)")
e = load("gpu_engine.json")
if e:
    print("\n  engine steady decode (gpu_engine.json): model, scheduling, batch, ms/step, tok/s, share of the streaming limit, "
          "GPU busy (profiler; bar: 95%), graph replay / step")
    for name, r in e.get("models", {}).items():
        for mode, rows in (("async", r.get("decode", [])), ("sync", r.get("decode_sync", []))):
          for row in rows:
            busy, share = row.get("gpu_busy"), row.get("graph_share_of_step")
            print(f"    {name:15s} {mode:5s} {row['batch']:4d} {row['step_s'] * 1e3:9.3f} {row['tokens_per_s']:10.1f} "
                  f"{row['ratio']:6.0%} {'-' if busy is None else f'{busy:.1%}':>7} "
                  f"{'-' if share is None else f'{share:.1%}':>7}")
        if "predicted" in r:
            p, m = r["predicted"], r["measured"]
            print(f"    {name:15s} KV tokens: --report {p['kv_tokens']:,} (datasheet), "
                  f"{p.get('kv_tokens_at_device_memory', 0):,} (device memory); engine {m['kv_tokens']:,}; "
                  f"graphs predicted {(p['graphs_bytes'] or 0) / 1e9:.2f} GB, measured {(m['graphs_bytes'] or 0) / 1e9:.2f} GB")
        if "error" in r:
            print(f"    {name:15s} ERROR {r['error']}")
s = load("gpu_deepseek_layer.json")
if s:
    layer = s.get("layer", {})
    print("\n  DeepSeek-V3 layer (gpu_deepseek_layer.json): batch, experts touched, limit us, measured us, share")
    for row in layer.get("decode", []):
        t = row["graph_s"] or row["eager_s"]
        print(f"    {row['batch']:4d} {row['distinct_experts']:4d} {row['limit_s'] * 1e6:9.1f} {t * 1e6:9.1f} "
              f"{row['ratio']:6.0%} ({row['timing']})")
    if "error" in layer:
        print(f"    ERROR {layer['error']}")
EOF
ok=0
for s in tests decode engine deepseek; do [ "${RC[$s]}" = 0 ] || [ "${RC[$s]}" = skipped ] || ok=1; done
exit $ok
