#!/usr/bin/env bash
# Sets up kiln and runs the main job on the embedded default: build a small Llama-architecture
# checkpoint, write its recipe, compile it for the cpu target, and generate text with the artifact.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
mkdir -p build
[ -f build/tiny-llama/config.json ] || python3 examples/make_tiny_checkpoint.py build/tiny-llama --arch llama
kiln recipe from-hf build/tiny-llama -o build/tiny_llama.dsl
kiln compile build/tiny_llama.dsl -o build/tiny_llama --report
kiln generate build/tiny_llama "Once upon a time" --max-tokens 24
python3 build/tiny_llama generate "The quick brown fox" --max-tokens 16 --temperature 0.8 --seed 1
