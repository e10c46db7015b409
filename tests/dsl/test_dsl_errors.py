"""Every user error is a SourceError at the exact file:line:col, printed with its line and a caret."""
from pathlib import Path

import pytest
from kiln.dsl import SourceError, load_recipe, parse
from kiln.dsl.errors import source_line

MODEL = """\
model tiny(vocab: int, hidden: int, layers: int = 2) {
  param embed: [vocab, hidden] from "embed"
  block layer[layers] {
    param w: [hidden, hidden] from "layers.{i}.w"
    forward(h) {
      return h + linear(h, w)
    }
  }
  forward(tokens) {
    h = layer(embedding(tokens, embed))
    return logits(h, embed)
  }
}
"""


def expect_error(fn, where: str, message: str) -> SourceError:
    with pytest.raises(SourceError) as info:
        fn()
    e = info.value
    assert str(e.loc) == where, e.format()
    assert message in e.message, e.message
    first, quoted, caret, *_ = e.format().splitlines()
    assert first == f"{where}: error: {e.message}"
    assert "\n" not in e.message and "Expected one of" not in e.message
    assert quoted == "  " + source_line(e.loc)
    assert caret.index("^") == 2 + e.loc.col - 1
    return e


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def recipe_file(tmp_path: Path, body: str, model: str = MODEL) -> str:
    return write(tmp_path, "r.dsl", model + "recipe r {\n" + body + "\n}\n")


# ---------------------------------------------------------------- syntax


def test_syntax_error_names_the_token_and_what_was_expected():
    src = "model m(a: int) {\n  forward(x) {\n    return (x + )\n  }\n}\n"
    e = expect_error(lambda: parse(src, "s.dsl"), "s.dsl:3:17", "unexpected ')' — expected an expression")
    assert e.format().splitlines()[2] == "                  ^"


def test_unterminated_string():
    src = 'recipe r {\n  weights = "hf:./ckpt\n}\n'
    e = expect_error(lambda: parse(src, "s.dsl"), "s.dsl:2:13", "unterminated string")
    assert e.format().splitlines()[2] == "  " + " " * 12 + "^" + "~" * 9


def test_unexpected_end_of_file():
    expect_error(lambda: parse("recipe r {\n  target = h200\n", "s.dsl"), "s.dsl:2:16",
                 "unexpected end of file — expected")


def test_statements_need_a_separator():
    expect_error(lambda: parse("recipe r { x = 1 y = 2 }", "s.dsl"), "s.dsl:1:18", "unexpected name 'y'")


# ---------------------------------------------------------------- recipes


def test_unknown_config_arg_suggests_the_right_one(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=32000, hiden=64)")
    e = expect_error(lambda: load_recipe(path), f"{path}:15:29",
                     "model 'tiny' has no config parameter 'hiden' — did you mean 'hidden'?")
    assert e.format().splitlines()[2].endswith("^~~~~")


def test_unknown_bundled_config_arg(tmp_path):
    path = write(tmp_path, "r.dsl", "recipe r {\n  model = llama(vocab=1, hidden=8, layers=1, heads=2, ffn=8,\n"
                                    "                rope_thta=1e6)\n}\n")
    expect_error(lambda: load_recipe(path), f"{path}:3:17", "did you mean 'rope_theta'?")


def test_missing_required_arg(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=32000)")
    expect_error(lambda: load_recipe(path), f"{path}:15:11", "model 'tiny' needs hidden: int")


def test_wrong_literal_type(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=32000, hidden=64, layers=2.5)")
    expect_error(lambda: load_recipe(path), f"{path}:15:47", "'layers' is int, got float 2.5")
    path = recipe_file(tmp_path, '  model = tiny(vocab="32000", hidden=64)')
    expect_error(lambda: load_recipe(path), f"{path}:15:22", "'vocab' is int, got str '32000'")


def test_unknown_model_suggests(tmp_path):
    path = recipe_file(tmp_path, "  model = tinny(vocab=1, hidden=2)")
    expect_error(lambda: load_recipe(path), f"{path}:15:11", "unknown model 'tinny' — did you mean 'tiny'?")


def test_unknown_section_key(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  kv_cache { block_size = 16; memory_frac = 0.9 }")
    expect_error(lambda: load_recipe(path), f"{path}:16:31",
                 "unknown key 'memory_frac' in section 'kv_cache' — did you mean 'memory_fraction'?")


def test_unknown_section(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  schedular { max_seqs = 4 }")
    expect_error(lambda: load_recipe(path), f"{path}:16:3", "unknown section 'schedular' — did you mean 'scheduler'?")


def test_bad_target(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  target = h20")
    expect_error(lambda: load_recipe(path), f"{path}:16:12", "'target' must be one of cpu, h100, h200, not 'h20'")


@pytest.mark.parametrize("entry, col, message", [
    ("kv_cache { block_size = 12 }", 27, "'block_size' must be a power of two, got 12"),
    ("kv_cache { memory_fraction = 1.5 }", 32, "'memory_fraction' must be a number in (0, 1]"),
    ("scheduler { policy = lifo }", 24, "'policy' must be one of fcfs, priority, effort"),
    ("scheduler { prefix_cache = lru }", 30, "'prefix_cache' must be one of radix, none"),
    ("parallel { tp = 0 }", 19, "'tp' must be a positive int, got 0"),
    ("cuda_graphs { batch_sizes = [1, -2] }", 35, "'batch_sizes' must be a positive int, got -2"),
    ("serve { port = 70000 }", 18, "'port' must be a port number"),
    ('passes { after fuse_qkv: "no_colon" }', 28, 'a pass is named "package.module:Class"'),
    ("quantize { after fuse_qkv: \"a:B\" }", 14, "belongs in the passes section"),
    ("dtype = fp64", 11, "'dtype' must be one of fp32, bf16, fp16"),
    ("weights = 3", 13, "'weights' must be a checkpoint"),
    ("kv_cache { offload = cpu(16) }", 24, "'offload' must be cpu(SIZE)"),
    ("tagret = h200", 3, "unknown recipe setting 'tagret' — did you mean 'target'?"),
    ("target = cpu; target = h200", 17, "'target' is set twice"),
])
def test_value_checks(tmp_path, entry, col, message):
    path = recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  " + entry)
    expect_error(lambda: load_recipe(path), f"{path}:16:{col}", message)


def test_a_recipe_needs_a_model(tmp_path):
    path = write(tmp_path, "r.dsl", "recipe r { target = cpu }\n")
    expect_error(lambda: load_recipe(path), f"{path}:1:8", "recipe 'r' has no 'model = NAME(...)'")


def test_a_str_config_value_must_be_quoted(tmp_path):
    path = write(tmp_path, "r.dsl", "recipe r {\n  model = llama(vocab=1, hidden=8, layers=1, heads=2, ffn=8, "
                                    "rope_scaling=llama3)\n}\n")
    expect_error(lambda: load_recipe(path), f"{path}:2:75", 'a string is written "llama3"')


def test_two_recipes_need_a_name(tmp_path):
    path = write(tmp_path, "r.dsl", MODEL + "recipe a { model = tiny(vocab=1, hidden=2) }\n"
                                            "recipe b { model = tiny(vocab=3, hidden=4) }\n")
    expect_error(lambda: load_recipe(path), f"{path}:15:8", "declares 2 recipes; name the one to use")
    assert load_recipe(path, "b").config["vocab"] == 3
    expect_error(lambda: load_recipe(path, "c"), f"{path}:1:1", "no recipe 'c'")


def test_use_of_a_missing_file(tmp_path):
    path = write(tmp_path, "r.dsl", 'use "models/gone.dsl"\nrecipe r { model = tiny(vocab=1) }\n')
    expect_error(lambda: load_recipe(path), f"{path}:1:5", "cannot find 'models/gone.dsl'")
    path = write(tmp_path, "s.dsl", "use lama\nrecipe r { model = tiny(vocab=1) }\n")
    expect_error(lambda: load_recipe(path), f"{path}:1:5", "no bundled model 'lama' — did you mean 'llama'?")


# ---------------------------------------------------------------- models


def model_error(src: str, where: str, message: str) -> SourceError:
    from kiln.dsl import check_model
    return expect_error(lambda: [check_model(m) for m in parse(src, "m.dsl").models], where, message)


def test_undefined_name_in_forward():
    model_error(MODEL.replace("linear(h, w)", "linear(h, ww)"), "m.dsl:6:28",
                "undefined name 'ww' — did you mean 'w'?")


def test_duplicate_param():
    src = MODEL.replace('    param w: [hidden, hidden] from "layers.{i}.w"\n',
                        '    param w: [hidden, hidden] from "layers.{i}.w"\n    param w: [hidden] from "x.{i}"\n')
    model_error(src, "m.dsl:5:11", "param 'w' is declared twice")
    # a block param may not reuse a top-level name either: block forwards see both
    model_error(MODEL.replace("param w:", "param embed:").replace("linear(h, w)", "linear(h, embed)"),
                "m.dsl:4:11", "param 'embed' is declared twice")


def test_duplicate_config_param():
    model_error("model m(a: int, a: int) { forward(x) { return x } }", "m.dsl:1:17",
                "config parameter 'a' is declared twice")


@pytest.mark.parametrize("old, new, where, message", [
    ("return h + linear(h, w)", "y = h + linear(h, w)", "m.dsl:6:7", "forward must end with 'return'"),
    ('from "embed"', 'from "embed.{i}"', "m.dsl:2:37", "defined only for params inside a block"),
    ('"layers.{i}.w"', '"layers.{j}.w"', "m.dsl:4:36", "unknown placeholder '{j}'"),
    ("block layer[layers]", "block layer[layerz]", "m.dsl:3:15", "undefined name 'layerz'"),
    ("param embed: [vocab, hidden]", "param embed: [vocab, h]", "m.dsl:2:24", "undefined name 'h'"),
    ("layers: int = 2", "layers: int = vocab // depth", "m.dsl:1:60", "undefined name 'depth'"),
    ("vocab: int, hidden: int,", "vocab: int = hidden, hidden: int,", "m.dsl:1:25", "'hidden' is used in"),
    ("return logits(h, embed)", "return logits(h, h > 1 ? embed : embed)", "m.dsl:11:22",
     "the condition of '?:' must be a config expression"),
    ("h = layer(", "embed = layer(", "m.dsl:10:5", "local 'embed' would shadow the param 'embed'"),
    ("return logits(h, embed)", "return logits(h, layer)", "m.dsl:11:22", "block 'layer' is not a value"),
])
def test_model_checks(old, new, where, message):
    assert old in MODEL
    model_error(MODEL.replace(old, new), where, message)
