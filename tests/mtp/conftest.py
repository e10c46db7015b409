"""Fixtures of the MTP tests: a tiny DeepSeek-V3 checkpoint with an MTP layer, compiled with kiln."""
from __future__ import annotations

import pytest
from mtp_testlib import add_mtp_layer


@pytest.fixture(scope="session")
def mtp_checkpoint(tiny_checkpoint_lib, tmp_path_factory):
    """`mtp_checkpoint(copies=True, repeat_head=False)` -> checkpoint dir: tiny DeepSeek-V3 (3 layers, 1 dense) +
    an MTP layer 3 (mtp_testlib.add_mtp_layer)."""
    cache = {}

    def make(copies: bool = True, repeat_head: bool = False):
        key = (copies, repeat_head)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"mtp_ckpt_{int(copies)}{int(repeat_head)}")
            tiny_checkpoint_lib.build_tiny_checkpoint(out, "deepseek_v3")
            add_mtp_layer(out, copies=copies, repeat_head=repeat_head)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def mtp_artifact(mtp_checkpoint, tmp_path_factory):
    """`mtp_artifact(copies=True, edits=(), no_mtp=False, repeat_head=False)` -> (checkpoint, artifact dir,
    CompileResult) via from-hf + compile."""
    import kiln
    from kiln.cli import main

    cache = {}

    def build(copies: bool = True, edits: tuple[tuple[str, str], ...] = (), no_mtp: bool = False,
              repeat_head: bool = False):
        key = (copies, edits, no_mtp, repeat_head)
        if key not in cache:
            ckpt = mtp_checkpoint(copies, repeat_head)
            work = tmp_path_factory.mktemp("mtp_art")
            recipe = work / "recipe.dsl"
            assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe), *(["--no-mtp"] if no_mtp else [])]) == 0
            text = recipe.read_text()
            for old, new in edits:
                assert old in text, f"edit {old!r} does not apply"
                text = text.replace(old, new, 1)
            recipe.write_text(text)
            cache[key] = (ckpt, work / "art", kiln.compile(recipe, work / "art", progress=False))
        return cache[key]

    return build
