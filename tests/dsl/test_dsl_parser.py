"""Parsing: bundled models, a full recipe, desugaring, literals and locations."""
from pathlib import Path

import pytest
from kiln.dsl import Loc, load_file, parse
from kiln.dsl import ast as A
from kiln.dsl.loader import bundled_models_dir

FULL_RECIPE = """\
# every section the DESIGN.md recipe shows, plus pass hooks
recipe llama3_8b_h200 {
  model    = llama(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
                   rope_theta=500000)
  weights  = "hf:./checkpoints/Meta-Llama-3-8B"     # or random(seed=0) for benchmarks
  target   = h200
  dtype    = bf16
  quantize    { weights = fp8(block=128); kv_cache = fp8 }
  parallel    { tp = 1; dp = 1; ep = 1; pp = 1 }
  kv_cache    { block_size = 16; memory_fraction = 0.90; offload = cpu(16GiB) }
  scheduler   { max_seqs = 256; max_batched_tokens = 8192; chunked_prefill = 512; policy = fcfs; prefix_cache = radix }
  speculative { method = ngram; tokens = 4 }
  lora        { max_loras = 8; max_rank = 16 }
  cuda_graphs { batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256] }
  disaggregate{ prefill = 1; decode = 1; transport = auto }
  serve       { port = 8000; served_name = "llama3-8b" }
  passes {
    after fuse_qkv: "mypkg.mod:MyPass"
    before kernel_selection: "mypkg.other:Late"
    disable = [fuse_gate_up]
  }
}
"""


def expr_of(text: str) -> A.Expr:
    return parse(f"recipe r {{ x = {text} }}", "<expr>").recipes[0].settings[0].value


def strip(e):
    """An expression as nested tuples without locations, for structural comparison."""
    match e:
        case A.Name(id):
            return id
        case A.Num(v) | A.Str(v) | A.Bool(v) | A.Size(v):
            return v
        case A.Call(func, args, kwargs):
            return (func, tuple(strip(a) for a in args), tuple((k, strip(v)) for k, v in kwargs))
        case A.BinOp(op, l, r):
            return (op, strip(l), strip(r))
        case A.UnaryOp(op, x):
            return (op, strip(x))
        case A.Ternary(c, t, f):
            return ("?:", strip(c), strip(t), strip(f))
        case A.List(items):
            return [strip(i) for i in items]
    raise AssertionError(e)


@pytest.mark.parametrize("path", sorted(bundled_models_dir().glob("*.dsl")), ids=lambda p: p.stem)
def test_bundled_models_parse_and_check(path: Path):
    module = load_file(path)
    (model,) = module.models
    assert model.name == path.stem
    # one block kind, or DeepSeek's first-k dense layers then mixture-of-experts layers (+ the MTP head's layer)
    assert [b.name for b in model.blocks] == (["dense", "moe", "mtp_layer"] if path.stem == "deepseek_v3"
                                              else ["decoder"])
    for decoder in model.blocks:
        assert decoder.forward.args == ("h",)
        assert isinstance(decoder.forward.body[-1], A.Return)
        rope = [s for s in decoder.forward.body if isinstance(s, A.Assign) and len(s.targets) == 2
                and isinstance(s.value, A.Call) and s.value.func == "rope"]  # q, k (MLA: q_pe, k_pe)
        assert len(rope) == 1
        assert all("{i}" in p.source.value for p in decoder.params)
    assert {p.name for p in model.params if not p.name.startswith("mtp_")} == {"embed", "norm", "lm_head"}
    assert [c.name for c in model.config[:4]] == ["vocab", "hidden", "layers", "heads"]


def test_qwen3_has_per_head_qk_norm():
    model = load_file(bundled_models_dir() / "qwen3.dsl").models[0]
    params = {p.name: p for p in model.blocks[0].params}
    assert params["q_norm"].source.value == "model.layers.{i}.self_attn.q_norm.weight"
    assert strip(params["k_norm"].shape[0]) == "head_dim"


def test_full_recipe_parses_every_section():
    module = parse(FULL_RECIPE, "full.dsl")
    (recipe,) = module.recipes
    assert recipe.name == "llama3_8b_h200" and recipe.loc == Loc("full.dsl", 2, 8, 22)
    assert [s.key for s in recipe.settings] == ["model", "weights", "target", "dtype"]
    assert [s.name for s in recipe.sections] == [
        "quantize", "parallel", "kv_cache", "scheduler", "speculative", "lora", "cuda_graphs",
        "disaggregate", "serve", "passes"]
    model = recipe.settings[0].value
    assert model.func == "llama" and dict(model.kwargs)["rope_theta"].value == 500000
    assert model.kwarg_locs[0] == Loc("full.dsl", 3, 20, 25)
    sections = {s.name: s for s in recipe.sections}
    assert strip(sections["quantize"].entries[0].value) == ("fp8", (), (("block", 128),))
    assert strip(sections["kv_cache"].entries[2].value) == ("cpu", (16 * 2**30,), ())
    assert strip(sections["cuda_graphs"].entries[0].value) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    hooks = sections["passes"].entries
    assert hooks[0] == A.PassHook("after", "fuse_qkv", A.Str("mypkg.mod:MyPass", Loc("full.dsl", 18, 21, 39)),
                                  Loc("full.dsl", 18, 5, 39))
    assert (hooks[1].position, hooks[1].anchor) == ("before", "kernel_selection")
    assert strip(hooks[2].value) == ["fuse_gate_up"]


def test_pipe_desugars_into_first_argument():
    assert strip(expr_of("x |> f(b, k=1)")) == ("f", ("x", "b"), (("k", 1),))
    assert strip(expr_of("linear(x, w) |> view(h, d) |> silu")) == \
        ("silu", (("view", (("linear", ("x", "w"), ()), "h", "d"), ()),), ())
    # the pipe binds loosest: the whole left side is piped
    assert strip(expr_of("a + b |> f")) == ("f", (("+", "a", "b"),), ())
    assert strip(expr_of("c ? a : b |> f")) == ("f", (("?:", "c", "a", "b"),), ())
    call = expr_of("x |> view(h, d)")
    assert call.loc == Loc("<expr>", 1, 21, 31)  # located at the call written right of |>


def test_precedence_shapes_the_tree():
    assert strip(expr_of("a || b && c == d + e * f ** g")) == \
        ("||", "a", ("&&", "b", ("==", "c", ("+", "d", ("*", "e", ("**", "f", "g"))))))
    assert strip(expr_of("-a ** 2")) == ("-", ("**", "a", 2))
    assert strip(expr_of("!a && b")) == ("&&", ("!", "a"), "b")
    assert strip(expr_of("a ? b : c ? d : e")) == ("?:", "a", "b", ("?:", "c", "d", "e"))


@pytest.mark.parametrize("text, value, kind", [
    ("1e-5", 1e-5, A.Num), ("500000", 500000, A.Num), ("10000.0", 10000.0, A.Num), ("-3", -3, A.Num),
    ("16GiB", 16 * 2**30, A.Size), ("512MiB", 512 * 2**20, A.Size), ("2GB", 2 * 10**9, A.Size),
    ('"a\\"b"', 'a"b', A.Str), ("true", True, A.Bool), ("false", False, A.Bool),
])
def test_literals(text, value, kind):
    e = expr_of(text)
    assert isinstance(e, kind) and e.value == value and type(e.value) is type(value)


def test_statements_separators_and_multi_target_assign():
    src = ("model m(a: int,\n        b: int = a // 2) {\n"
           "  param w: [a, b] from \"w\"; param c: [a] from \"c\" if b > 1\n"
           "  block layer[a] { param v: [b] from \"l.{i}.v\"; forward(h) { return h } }\n"
           "  forward(t) {\n\n    # comment\n    q, k = rope(t,\n                t, theta=1.0)\n"
           "    return layer(q + k)\n  }\n}\n")
    model = parse(src, "m.dsl").models[0]
    assert [p.name for p in model.params] == ["w", "c"] and model.params[1].cond is not None
    assign = model.forward.body[0]
    assert assign.targets == ("q", "k") and assign.loc.line == 8
    assert strip(assign.value) == ("rope", ("t", "t"), (("theta", 1.0),))
    ret = model.forward.body[1]
    assert strip(ret.value) == ("layer", (("+", "q", "k"),), ())  # a block call is an ordinary Call
    assert model.config[1].loc == Loc("m.dsl", 2, 9, 10)


def test_keywords_are_contextual():
    # `block` and `model` are keywords only where a declaration can start
    assert strip(expr_of("fp8(block=128)")) == ("fp8", (), (("block", 128),))
    module = parse("recipe r { model = llama(vocab=1) }", "k.dsl")
    assert module.recipes[0].settings[0].key == "model"


def test_use_declarations():
    module = parse('use llama\nuse "../x/y.dsl"; recipe r { model = llama(vocab=1) }\n', "u.dsl")
    assert [(u.target, u.is_path) for u in module.uses] == [("llama", False), ("../x/y.dsl", True)]
    assert module.uses[1].loc == Loc("u.dsl", 2, 5, 17)
