"""Fixtures of the LoRA tests: random PEFT adapters over the tiny llama checkpoint, and artifacts with them."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from lora_testlib import lora_recipe, make_adapter  # noqa: E402

pytest.importorskip("peft")


@pytest.fixture(scope="session")
def adapter(tiny_checkpoint, tiny_checkpoint_lib, tmp_path_factory):
    """`adapter(targets, seed=0, rank=8, **LoraConfig kw) -> Path`: a random PEFT adapter over tiny llama, built
    once per session per distinct call."""
    root = tmp_path_factory.mktemp("adapters")
    cache: dict[tuple, pathlib.Path] = {}

    def make(targets, *, seed: int = 0, rank: int = 8, **kw) -> pathlib.Path:
        key = (tuple(targets), seed, rank, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            base = tiny_checkpoint_lib.load_hf_model(tiny_checkpoint("llama"))
            cache[key] = make_adapter(base, root / f"adapter-{len(cache)}", targets=targets, rank=rank, seed=seed,
                                      **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def compile_lora(tiny_checkpoint, tmp_path_factory):
    """`compile_lora(section, adapters={name: path}) -> artifact dir`: tiny llama compiled with `lora { section;
    adapters = {...} }` (adapters given as absolute hf: paths), once per distinct call."""
    import kiln
    from kiln.cli import main

    root = tmp_path_factory.mktemp("lora_artifacts")
    cache: dict[tuple, pathlib.Path] = {}

    def build(section: str, adapters: dict[str, pathlib.Path] | None = None) -> pathlib.Path:
        key = (section, tuple(sorted((k, str(v)) for k, v in (adapters or {}).items())))
        if key not in cache:
            work = root / f"art-{len(cache)}"
            work.mkdir()
            recipe = work / "recipe.dsl"
            assert main(["recipe", "from-hf", str(tiny_checkpoint("llama")), "-o", str(recipe)]) == 0
            entries = section
            if adapters:
                entries += "; adapters = { " + ", ".join(f'{k}: "hf:{v}"' for k, v in adapters.items()) + " }"
            recipe.write_text(lora_recipe(recipe.read_text(), entries))
            kiln.compile(recipe, work / "art", progress=False)
            cache[key] = work / "art"
        return cache[key]

    return build
