"""The artifact a benchmark runs: the embedded model when its checkpoint exists, else a tiny random Llama.

Both are compiled once into build/bench/ (ignored by git) and reused while the recipe and checkpoint are
unchanged."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
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


def ensure_artifact(which: str = "auto") -> tuple[str, Path]:
    """(name, artifact dir) for `which` in auto | embedded | tiny; compiles when missing or stale."""
    if which == "embedded" or (which == "auto" and embedded_available()):
        assert embedded_available(), f"no embedded checkpoint in {EMBEDDED_CKPT}"
        out = BUILD / "embedded"
        if _stale(out, EMBEDDED_RECIPE, EMBEDDED_CKPT):
            _kiln("compile", str(EMBEDDED_RECIPE), "-o", str(out), "--no-progress")
        return "embedded", out
    ckpt, recipe, out = BUILD / "tiny-ckpt", BUILD / "tiny.dsl", BUILD / "tiny"
    if not (ckpt / "config.json").exists():
        spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", REPO / "examples" / "make_tiny_checkpoint.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build_tiny_checkpoint(ckpt, "llama")
    if _stale(out, ckpt):
        _kiln("recipe", "from-hf", str(ckpt), "-o", str(recipe))
        _kiln("compile", str(recipe), "-o", str(out), "--no-progress")
    return "tiny-llama", out
