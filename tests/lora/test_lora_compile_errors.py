"""What `lora { }` refuses at compile time, each at its place in the recipe (file:line:col): adapters kiln would
serve differently from PEFT (DoRA, targets it has no branch for, ranks above max_rank), and the options LoRA
does not compose with (a speculative draft head, sharded weights: tp/dp > 1)."""
from __future__ import annotations

import re

import pytest
from kiln.dsl.errors import SourceError
from lora_testlib import ATTENTION, lora_recipe

import kiln
from kiln.cli import main


@pytest.fixture(scope="module")
def recipe_text(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_recipe") / "recipe.dsl"
    assert main(["recipe", "from-hf", str(tiny_checkpoint("llama")), "-o", str(path)]) == 0
    return path.read_text()


def _compile(tmp_path, recipe_text, section, extra="", out=True):
    recipe = tmp_path / "recipe.dsl"
    text = lora_recipe(recipe_text, section)
    if extra:
        text = text.replace("  lora {", f"  {extra}\n  lora {{")
    recipe.write_text(text)
    return recipe, (lambda: kiln.compile(recipe, tmp_path / "art" if out else None, progress=False))


def _line_col(recipe, needle: str) -> str:
    for n, line in enumerate(recipe.read_text().splitlines(), start=1):
        if needle in line:
            return f"{recipe}:{n}:{line.index(needle) + 1}"
    raise AssertionError(needle)


@pytest.mark.parametrize("kind,kw,message", [
    ("dora", dict(targets=ATTENTION, use_dora=True), "DoRA adapters (use_dora) are not supported"),
    ("lm_head", dict(targets=["q_proj", "lm_head"]), "targets module 'lm_head', which this artifact has no LoRA"),
    ("embedding", dict(targets=["embed_tokens"]), "targets module 'embed_tokens'"),
    ("rank", dict(targets=ATTENTION, rank=16), "has rank 16, above this artifact's lora.max_rank = 8"),
])
def test_adapters_kiln_cannot_serve_are_refused_at_their_place(kind, kw, message, adapter, recipe_text, tmp_path):
    path = adapter(seed=5, **kw)
    recipe, run = _compile(tmp_path, recipe_text, f'max_rank = 8; adapters = {{ ok: "hf:{path}" }}')
    with pytest.raises(SourceError, match=re.escape(message)) as e:
        run()
    assert str(e.value).startswith(_line_col(recipe, f'"hf:{path}"'))
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("extra,key,message", [
    ("speculative { method = mtp; tokens = 1 }", "method = mtp", "LoRA with speculative method = mtp is not supported"),
    # tp composes with LoRA (tests/lora/test_lora_tensor_parallel.py); dp and ep do not yet
    ("parallel { tp = 2; ep = 2 }", "ep = 2", "LoRA with parallel.ep = 2 is not supported"),
    ("parallel { dp = 2 }", "dp = 2", "LoRA with parallel.dp = 2 is not supported"),
])
def test_options_lora_does_not_compose_with(extra, key, message, recipe_text, tmp_path):
    recipe, run = _compile(tmp_path, recipe_text, "max_loras = 2", extra=extra)
    with pytest.raises(SourceError, match=message) as e:
        run()
    assert str(e.value).startswith(_line_col(recipe, key).rsplit(":", 1)[0] + ":"), str(e.value)


@pytest.mark.parametrize("section,message", [
    ('adapters = "hf:x"', "'adapters' must be a map of names to PEFT directories"),
    ('adapters = { a: "hf:./nowhere" }', "does not exist"),
    ('adapters = { a: "./x" }', "must be a Hugging Face directory"),
    ('adapters = { a: "hf:x", a: "hf:y" }', "key 'a' appears twice in this map"),
    ("max_loras = 0", "'max_loras' must be a positive int"),
])
def test_bad_lora_values(section, message, recipe_text, tmp_path):
    recipe, run = _compile(tmp_path, recipe_text, section)
    with pytest.raises(SourceError, match=re.escape(message)) as e:
        run()
    assert re.match(rf"{re.escape(str(recipe))}:\d+:\d+", str(e.value)), str(e.value)


def test_cli_exit_2_without_traceback(recipe_text, tmp_path, capsys):
    recipe, _ = _compile(tmp_path, recipe_text, 'adapters = { a: "hf:./nowhere" }')
    assert main(["compile", str(recipe), "-o", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_a_recipe_without_lora_has_no_lora_pass_or_section(compile_hf):
    _, art, result = compile_hf("llama")
    assert "lora_injection" not in [p["name"] for p in result.pass_log]
    assert "lora" not in result.manifest and "def lora(" not in (art / "kernels" / "cpu.py").read_text()
