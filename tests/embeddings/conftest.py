"""The tiny embedding artifacts: a random tiny Qwen3 with a sentence-transformers config (modules.json, 1_Pooling,
2_Normalize), its recipe from `kiln recipe from-hf` (which reads task = embed from modules.json), compiled."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


def write_sentence_transformers(ckpt: Path, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (ckpt / "modules.json").write_text(json.dumps(modules))
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_lasttoken": pooling == "last",
        "pooling_mode_mean_tokens": pooling == "mean"}))


@pytest.fixture(scope="session")
def sentence_transformers_config() -> Callable[[Path, str, bool], None]:
    """`sentence_transformers_config(ckpt, pooling, normalize)` writes modules.json and 1_Pooling/config.json."""
    return write_sentence_transformers


@pytest.fixture(scope="session")
def build_embed(tiny_checkpoint_lib) -> Callable[..., tuple[Path, Path]]:
    """`build_embed(root, pooling, normalize, chunk=512, matryoshka=None) -> (checkpoint, artifact)`; `matryoshka`:
    the config.json's `matryoshka_dimensions`."""
    import kiln
    from kiln.cli import main

    def build(root: Path, pooling: str, normalize: bool, chunk: int = 512,
              matryoshka: list[int] | None = None) -> tuple[Path, Path]:
        ckpt = tiny_checkpoint_lib.build_tiny_checkpoint(root / "ckpt", "qwen3")
        if matryoshka is not None:
            config = json.loads((ckpt / "config.json").read_text())
            (ckpt / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": matryoshka}))
        write_sentence_transformers(ckpt, pooling, normalize)
        recipe = root / "r.dsl"
        assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
        text = recipe.read_text()
        assert text.count("\n  task    = embed\n") == 1 and "modules.json lists a sentence-transformers" in text
        text = text.replace("chunked_prefill = 512", f"chunked_prefill = {chunk}", 1)
        assert f"chunked_prefill = {chunk}" in text
        recipe.write_text(text)
        kiln.compile(recipe, root / "art", progress=False)
        return ckpt, root / "art"

    return build
