#!/usr/bin/env bash
# Sets up kiln and runs the main job on the embedded default model (examples/embedded, a small Llama
# trained on Debian's fortune cookies): compile its recipe for the cpu target, generate, then serve it
# behind the OpenAI-compatible API and ask it something. Everything runs in the project venv (.venv/, set up
# by scripts/venv.sh); nothing is installed into the system's python3.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # small models on few cores: one torch thread is fastest

echo "== kiln compile examples/embedded.dsl -o build/embedded --report"
kiln compile examples/embedded.dsl -o build/embedded --report

echo "== kiln generate build/embedded"
kiln generate build/embedded "A wise man once said" --max-tokens 40 --temperature 0.8 --top-p 0.95 --seed 7

port=${PORT:-8123}
echo "== kiln serve build/embedded --port $port"
kiln serve build/embedded --port "$port" > build/serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 $server 2>/dev/null || { cat build/serve.log; exit 1; }
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/v1/models"; echo
curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "kiln-embedded",
  "messages": [{"role": "user", "content": "Tell me a fortune."}],
  "max_tokens": 48, "temperature": 0.8, "seed": 3}'
echo
curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^kiln:(request_success_total|generation_tokens_total)' || true
