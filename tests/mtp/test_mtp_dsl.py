"""The DSL pieces the MTP head is written with — a named second forward, `block b[n] like a`, config values and
`else` fallbacks in tensor names, a forward returning logits and a hidden state — lowered to IR (round trip
through the IR text form), and their mistakes reported at file:line:col."""
from __future__ import annotations

import pytest
from kiln.compiler.instantiate import instantiate_model
from kiln.compiler.text import graphs_equal, parse_program, print_program
from kiln.compiler.verifier import verify_program
from kiln.dsl import SourceError, parse
from kiln.dsl import ast as A
from kiln.dsl.check import check_module

MODEL = """\
model tiny(vocab: int, hidden: int, layers: int = 2, heads: int = 1, draft: int = 1) {
  param embed: [vocab, hidden] from "embed"
  block layer[layers] {
    param w: [hidden, hidden] from "layers.{i}.w"
    forward(h) {
      return h + linear(h, w)
    }
  }
  block head_layer[1] like layer
  param proj: [hidden, 2 * hidden] from "layers.{layers}.proj" if draft > 0
  param head: [vocab, hidden] from "layers.{layers}.head" else "embed" if draft > 0
  forward(tokens) {
    h = layer(embedding(tokens, embed))
    return logits(h, embed), h
  }
  forward nextnext(tokens, h_main) if draft > 0 {
    h = linear(concat(embedding(tokens, embed), h_main), proj)
    return logits(head_layer(h), head)
  }
}
"""


def _program(text: str = MODEL, **config):
    module = parse(text, "m.dsl")
    check_module(module)
    (model,) = module.models
    args = {k: A.Num(v, None) for k, v in {"vocab": 16, "hidden": 8, **config}.items()}
    return instantiate_model(model, args)


def test_named_forward_lowers_to_a_second_graph_after_the_entry():
    p = _program()
    verify_program(p)
    assert p.forward_graphs() == ["entry", "nextnext"]
    assert len(p.entry.outputs) == 2  # logits, then the hidden state the draft head reads
    assert [b.first_layer for b in p.blocks.values()] == [0, 2]  # the head's layer follows the stack
    assert p.params["proj"].source == ("layers.2.proj",)  # {layers} filled from the config
    assert p.params["head"].source == ("layers.2.head",) and p.params["head"].fallback == ("embed",)
    assert p.params["head_layer.w"].source == ("layers.{i}.w",)  # `like`: the same params, its own layers
    assert p.layer_schedule() == [("layer", 0), ("layer", 1), ("head_layer", 0)]
    back = parse_program(print_program(p))
    assert back.params["head"].fallback == ("embed",)
    assert all(graphs_equal(p.graphs[g], back.graphs[g]) for g in p.graphs)


def test_condition_false_leaves_the_forward_out():
    p = _program(draft=0)
    assert p.forward_graphs() == ["entry"] and "proj" not in p.params and "head_layer" not in p.blocks


@pytest.mark.parametrize("old,new,where,message", [
    ("block head_layer[1] like layer", "block head_layer[1] like layr", "m.dsl:9:28",
     "declared like 'layr', which is not a block"),
    ("forward nextnext(tokens, h_main)", "forward nextnext(tokens, h_main, extra)", "m.dsl:16:3",
     "takes the token ids and the 1 hidden state(s) the model's forward returns after its logits: 2 arguments"),
    ('"layers.{layers}.proj"', '"layers.{layrs}.proj"', "m.dsl:10:41", "unknown placeholder '{layrs}'"),
    ("forward nextnext(", "forward embed(", "m.dsl:16:3", "forward 'embed' has the name of a param"),
    ("      return h + linear(h, w)", "      return h, linear(h, w)", "m.dsl:5:5", "must return one tensor"),
])
def test_mistakes_are_located(old, new, where, message):
    text = MODEL.replace(old, new)
    assert text != MODEL
    with pytest.raises(SourceError) as info:
        _program(text)
    assert str(info.value.loc) == where, info.value.format()
    assert message in info.value.message, info.value.message


def test_named_forward_inside_a_block_is_refused():
    text = MODEL.replace("    forward(h) {\n      return h + linear(h, w)\n    }",
                         "    forward(h) {\n      return h + linear(h, w)\n    }\n    forward extra(h) { return h }")
    with pytest.raises(SourceError, match="named forwards belong to the model"):
        _program(text)
