"""The artifact a benchmark runs: the embedded model when its checkpoint exists, else a tiny random Llama.

Both are compiled once into build/bench/ (ignored by git) and reused while the recipe and checkpoint are
unchanged."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_CKPT = REPO / "examples" / "embedded"
EMBEDDED_RECIPE = REPO / "examples" / "embedded.dsl"
BUILD = REPO / "build" / "bench"


def embedded_available() -> bool:
    return EMBEDDED_RECIPE.exists() and (EMBEDDED_CKPT / "config.json").exists() and any(
        EMBEDDED_CKPT.glob("*.safetensors"))


def _stale(artifact: Path, *inputs: Path) -> bool:
    manifest = artifact / "manifest.json"
    if not manifest.exists():
        return True
    built = manifest.stat().st_mtime
    return any(p.stat().st_mtime > built for src in inputs for p in ([src] if src.is_file() else src.rglob("*")))


def _kiln(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kiln.cli", *args], check=True, cwd=REPO)


# `long`: a random Llama of the embedded model's width with a 4K context, for 2K-token prompts (the embedded
# model's context is 512)
LONG = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 4096}


def _tiny_checkpoint(ckpt: Path, **config) -> None:
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", REPO / "examples" / "make_tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_tiny_checkpoint(ckpt, "llama", **config)


def ensure_artifact(which: str = "auto") -> tuple[str, Path]:
    """(name, artifact dir) for `which` in auto | embedded | tiny | long; compiles when missing or stale."""
    if which == "embedded" or (which == "auto" and embedded_available()):
        assert embedded_available(), f"no embedded checkpoint in {EMBEDDED_CKPT}"
        out = BUILD / "embedded"
        if _stale(out, EMBEDDED_RECIPE, EMBEDDED_CKPT):
            _kiln("compile", str(EMBEDDED_RECIPE), "-o", str(out), "--no-progress")
        return "embedded", out
    name = "long" if which == "long" else "tiny"
    ckpt, recipe, out = BUILD / f"{name}-ckpt", BUILD / f"{name}.dsl", BUILD / name
    if not (ckpt / "config.json").exists():
        _tiny_checkpoint(ckpt, **(LONG if name == "long" else {}))
    if _stale(out, ckpt):
        _kiln("recipe", "from-hf", str(ckpt), "-o", str(recipe))
        _kiln("compile", str(recipe), "-o", str(out), "--no-progress")
    return ("long-llama (random, hidden 256, 4 layers, 4K context)" if name == "long" else "tiny-llama"), out


@contextlib.contextmanager
def kiln_server(artifact: Path, *flags: str, timeout: float = 120.0) -> Iterator[str]:
    """`kiln serve ARTIFACT FLAGS` on a free port of 127.0.0.1; yields its URL once /health answers; stops it."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *flags]
    server = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert server.poll() is None, "kiln serve exited"
            assert time.monotonic() < deadline, f"kiln serve did not come up in {timeout:.0f} s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(15)


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus text exposition's samples of `name` (every label set)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))
