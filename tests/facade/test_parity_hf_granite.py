"""IBM Granite 3.x (GraniteForCausalLM) end to end against Hugging Face transformers: a random tiny checkpoint
whose four scalars are all away from 1 (embedding multiplier 3, residual multiplier 0.5, attention multiplier
0.2 instead of head_dim ** -0.5 = 0.25, logits divided by 4; examples/make_tiny_checkpoint.py "granite") ->
`kiln recipe from-hf` -> `kiln compile` (cpu) -> `kiln.LLM`: fp32 prompt logprobs within 1e-4 of HF and 32
greedy tokens identical (tests/conftest.py check_hf_parity); a scalar transformers would divide by zero with,
or one that is not a number, is refused at its place in config.json."""
from __future__ import annotations

import json

import pytest


def test_granite_matches_hf(compile_hf, check_hf_parity):
    ckpt, art, _ = compile_hf("granite")
    recipe = (art.parent / "recipe.dsl").read_text()
    for line in ("embedding_multiplier=3.0", "residual_multiplier=0.5", "attention_multiplier=0.2",
                 "logits_scaling=4.0"):
        assert line in recipe  # from-hf read each scalar from config.json
    check_hf_parity(art, ckpt, vocab=512)


@pytest.mark.parametrize("key, value, message", [
    ("logits_scaling", 0, "'logits_scaling' must be a finite number other than 0"),
    ("residual_multiplier", "half", "'residual_multiplier' must be a finite number"),
])
def test_a_bad_scalar_is_refused_at_its_key(tiny_checkpoint, tmp_path, capsys, key, value, message):
    import shutil

    from kiln.cli import main

    ckpt = tmp_path / "granite"
    shutil.copytree(tiny_checkpoint("granite"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(tmp_path / "r.dsl")]) == 2
    err = capsys.readouterr().err
    assert message in err and "config.json:" in err and "Traceback" not in err
