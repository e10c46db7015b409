"""Heterogeneous layer stacks: each block is called once, from the model's forward; `BlockSpec.first_layer` is
where its layers start in the layer schedule, and `{i}` in a param source is that global layer index."""
from __future__ import annotations

import dataclasses

import pytest
from kiln.codegen.weights import weight_entries
from kiln.compiler import VerifyError, parse_program, print_program, verify_program
from kiln.compiler.instantiate import instantiate_model
from kiln.dsl import ast as A
from kiln.dsl import load_file
from kiln.dsl.errors import SourceError

MODEL = """
model m(vocab: int = 16, hidden: int = 8, layers: int = 5, first_k: int = 2) {
  param embed: [vocab, hidden] from "model.embed_tokens.weight"
  block dense[first_k] {
    param w: [hidden, hidden] from "model.layers.{i}.mlp.weight"
    forward(h) { return h + linear(h, w) }
  }
  block wide[layers - first_k] {
    param w: [hidden, hidden] from "model.layers.{i}.mlp.weight"
    param g: [hidden] from "model.layers.{i}.norm.weight"
    forward(h) { return h + linear(rms_norm(h, g), w) }
  }
  forward(tokens) {
    h = embedding(tokens, embed)
    h = first_k > 0 ? dense(h) : h
    h = first_k < layers ? wide(h) : h
    return logits(h, embed)
  }
}
"""


def _program(tmp_path, text=MODEL, **config):
    p = tmp_path / "m.dsl"
    p.write_text(text)
    (model,) = load_file(p).models
    return instantiate_model(model, {k: A.Num(v, None) for k, v in config.items()})


def test_first_layer_follows_the_order_of_block_calls(tmp_path):
    program = _program(tmp_path)
    assert [(b.name, b.count, b.first_layer) for b in program.blocks.values()] == [("dense", 2, 0), ("wide", 3, 2)]
    assert program.layer_schedule() == [("dense", 0), ("dense", 1), ("wide", 0), ("wide", 1), ("wide", 2)]
    verify_program(program)
    sources = {e.name: e.spec.sources_for(e.layer) for e in weight_entries(program)}
    assert sources["dense.1.w"] == ("model.layers.1.mlp.weight",)
    assert sources["wide.0.w"] == ("model.layers.2.mlp.weight",)  # artifact names stay block-local
    assert sources["wide.2.g"] == ("model.layers.4.norm.weight",)


def test_a_block_left_out_of_the_schedule(tmp_path):
    program = _program(tmp_path, first_k=0)
    assert [(b.name, b.first_layer) for b in program.blocks.values()] == [("wide", 0)]
    last = weight_entries(program)[-1]
    assert (last.name, last.spec.sources_for(last.layer)) == ("wide.4.g", ("model.layers.4.norm.weight",))


def test_text_form_round_trips_first_layer(tmp_path):
    program = _program(tmp_path)
    text = print_program(program)
    assert "  block dense = dense x 2\n" in text and "  block wide = wide x 3 {first_layer=2}\n" in text
    again = parse_program(text)
    assert again.blocks == program.blocks
    assert print_program(again) == text


def test_verifier_holds_first_layer_to_the_schedule(tmp_path):
    program = _program(tmp_path)
    blocks = dict(program.blocks)
    blocks["wide"] = dataclasses.replace(blocks["wide"], first_layer=0)
    with pytest.raises(VerifyError, match="'wide' has first_layer=0, but its layers start at 2"):
        verify_program(dataclasses.replace(program, blocks=blocks))


@pytest.mark.parametrize("forward, message", [
    ("h = dense(dense(embedding(tokens, embed)))", "block 'dense' is called twice"),
    ("h = wide(dense(embedding(tokens, embed)))\n    h = wide(h)", "block 'wide' is called twice"),
])
def test_a_block_is_called_once(tmp_path, forward, message):
    text = MODEL.replace("h = embedding(tokens, embed)\n    h = first_k > 0 ? dense(h) : h\n"
                         "    h = first_k < layers ? wide(h) : h", forward)
    assert text != MODEL
    with pytest.raises(SourceError, match=message):
        _program(tmp_path, text)


def test_blocks_do_not_nest(tmp_path):
    text = MODEL.replace("forward(h) { return h + linear(rms_norm(h, g), w) }",
                         "forward(h) { return dense(h) + linear(rms_norm(h, g), w) }")
    text = text.replace("h = first_k > 0 ? dense(h) : h\n", "")
    with pytest.raises(SourceError, match="block 'wide' calls block 'dense'"):
        _program(tmp_path, text)
