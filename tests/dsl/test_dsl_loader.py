"""Model resolution: same file, `use` of paths and bundled names, automatic bundled models."""
from pathlib import Path

import pytest
from kiln.dsl import LoadedRecipe, SourceError, bundled_models_dir, load_recipe

TINY = """\
model tiny(vocab: int, hidden: int = 8) {
  param embed: [vocab, hidden] from "embed"
  forward(tokens) { return logits(embedding(tokens, embed), embed) }
}
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_bundled_models_dir_holds_the_models():
    assert {"llama", "qwen2", "qwen3"} <= {p.stem for p in bundled_models_dir().glob("*.dsl")}


def test_model_in_the_same_file(tmp_path):
    loaded = load_recipe(write(tmp_path, "r.dsl", TINY + "recipe r { model = tiny(vocab=16) }\n"))
    assert isinstance(loaded, LoadedRecipe)
    assert loaded.model.name == "tiny" and loaded.config == {"vocab": 16, "hidden": 8}
    assert loaded.recipe.name == "r" and loaded.file.endswith("r.dsl")


def test_use_resolves_relative_to_the_using_file(tmp_path):
    write(tmp_path, "lib/models/tiny.dsl", TINY)
    write(tmp_path, "lib/all.dsl", 'use "models/tiny.dsl"\n')
    path = write(tmp_path, "recipes/r.dsl", 'use "../lib/all.dsl"\nrecipe r { model = tiny(vocab=4) }\n')
    loaded = load_recipe(path)  # transitive: r.dsl uses all.dsl, which uses models/tiny.dsl
    assert loaded.model.loc.file == str(tmp_path / "lib/models/tiny.dsl")


def test_use_cycles_load_each_file_once(tmp_path):
    write(tmp_path, "a.dsl", 'use "b.dsl"\n' + TINY)
    write(tmp_path, "b.dsl", 'use "a.dsl"\n')
    path = write(tmp_path, "r.dsl", 'use "a.dsl"\nuse "b.dsl"\nrecipe r { model = tiny(vocab=4) }\n')
    assert set(load_recipe(path).models) == {"tiny"}


def test_use_of_a_bundled_name(tmp_path):
    path = write(tmp_path, "r.dsl", "use qwen3\nrecipe r {\n  model = qwen3(vocab=100, hidden=64, layers=2, "
                                    "heads=4, kv_heads=2, ffn=128, head_dim=32)\n}\n")
    loaded = load_recipe(path)
    assert loaded.config["head_dim"] == 32 and loaded.config["rope_theta"] == 1e6
    assert Path(loaded.model.loc.file) == bundled_models_dir() / "qwen3.dsl"


def test_bundled_model_is_found_without_use(tmp_path):
    path = write(tmp_path, "r.dsl", "recipe r {\n  model = llama(vocab=128256, hidden=4096, layers=32, heads=32, "
                                    "kv_heads=8, ffn=14336, rope_theta=500000)\n  weights = random(seed=0)\n}\n")
    loaded = load_recipe(path)
    assert set(loaded.models) == {"llama"}
    assert loaded.config["head_dim"] == 128 and loaded.config["kv_heads"] == 8
    assert loaded.config["rope_theta"] == 500000.0 and isinstance(loaded.config["rope_theta"], float)


def test_a_model_declared_in_two_files_is_an_error(tmp_path):
    write(tmp_path, "other.dsl", TINY)
    path = write(tmp_path, "r.dsl", 'use "other.dsl"\n' + TINY + "recipe r { model = tiny(vocab=1) }\n")
    with pytest.raises(SourceError, match="model 'tiny' is declared twice") as info:
        load_recipe(path)
    assert info.value.loc.file == str(tmp_path / "other.dsl")


def test_a_missing_recipe_file():
    with pytest.raises(SourceError, match="cannot read"):
        load_recipe("/nonexistent/recipe.dsl")


def test_a_file_without_recipes(tmp_path):
    with pytest.raises(SourceError, match="declares no recipe"):
        load_recipe(write(tmp_path, "m.dsl", TINY))
