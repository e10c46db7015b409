"""compiler/options.py: the recipe's settings and sections checked against the option dataclasses' fields (one
list of keys: each field declares its check), every error at its place; defaults filled once."""
import sys
from pathlib import Path

import pytest
from kiln.compiler.options import RecipeOptions, SchedulerOptions, recipe_options
from kiln.dsl import load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dsl"))
from test_dsl_errors import expect_error, recipe_file  # noqa: E402


def _options(path: str) -> RecipeOptions:
    return recipe_options(load_recipe(path).recipe)


def test_unknown_section_key(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  kv_cache { block_size = 16; memory_frac = 0.9 }")
    expect_error(lambda: _options(path), f"{path}:16:31",
                 "unknown key 'memory_frac' in section 'kv_cache' — did you mean 'memory_fraction'?")


def test_unknown_section(tmp_path):
    path = recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  schedular { max_seqs = 4 }")
    expect_error(lambda: _options(path), f"{path}:16:3", "unknown section 'schedular' — did you mean 'scheduler'?")


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
    expect_error(lambda: _options(path), f"{path}:16:{col}", message)


def test_defaults_are_filled_once_and_typed(tmp_path):
    opts = _options(recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n"
                                          "  scheduler { max_seqs = 4; chunked_prefill = false; preemption = swap }\n"
                                          "  quantize { weights = fp8(block=128) }"))
    # max_batched_tokens, left out, is the target's (tests/compiler/test_step_budget.py)
    assert opts.scheduler == SchedulerOptions(max_seqs=4, max_batched_tokens=2048, chunked_prefill=None,
                                              preemption="swap")
    assert (opts.quantize.weights.kind, opts.quantize.weights.block) == ("fp8", 128)
    assert opts.kv_cache.block_size == 16 and opts.serve.port == 8000 and opts.target == "cpu"
    assert opts.set_sections == {"scheduler", "quantize"}
    assert str(opts.loc("scheduler.max_seqs")).endswith(":16:26")
    assert RecipeOptions.from_meta(opts.to_meta()) is opts  # what a Program carries
    assert RecipeOptions.from_meta({"scheduler": {"max_seqs": 4}}).scheduler.max_batched_tokens == 2048  # cpu's
    assert RecipeOptions.from_meta({"target": "h200"}).scheduler.max_batched_tokens == 8192


def test_chunked_prefill_true_is_the_default_chunk(tmp_path):
    """`chunked_prefill = true` chunks at the default size (the runtime once read it as a 1-token chunk)."""
    opts = _options(recipe_file(tmp_path, "  model = tiny(vocab=1, hidden=2)\n  scheduler { chunked_prefill = true }"))
    assert opts.scheduler.chunked_prefill == SchedulerOptions().chunked_prefill == 512


def test_a_recipe_key_is_a_field_with_its_check():
    """Adding a recipe key is a field here: the syntax check, the did-you-mean and the default follow from it."""
    import dataclasses

    from kiln.compiler.options import SECTIONS, _checks

    assert set(_checks(SECTIONS["kv_cache"])) == {f.name for f in dataclasses.fields(SECTIONS["kv_cache"])}
    assert "spelling" not in _checks(SECTIONS["quantize"])  # not a recipe key: no check
