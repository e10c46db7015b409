"""IR text form: print -> parse -> print round trips, and structural graph comparison."""
import pytest
from kiln.compiler import graphs_equal, parse_graph, parse_program, print_graph, print_program
from kiln.compiler.text import IRParseError

GRAPH = """
graph decoder {
  %h = input "h" : f32[T, 8]
  %w = param "decoder.norm" : f32[8]
  %x = rms_norm(%h, %w) {eps=1e-05} : f32[T, 8]
  %wq = param "decoder.wq" : f32[8, 8]
  %q = linear(%x, %wq) : f32[T, 8]
  %q3 = view(%q) {shape=[2, 4]} : f32[T, 2, 4]
  %r = rope(%q3) {scaling="llama3", theta=500000.0} : f32[T, 2, 4]
  %t = add_rms_norm(%h, %x, %w) {eps=1e-05} : (f32[T, 8], f32[T, 8])
  %n = getitem(%t) {index=0} : f32[T, 8]
  return %n, %r
}
"""

PROGRAM = """
program tiny dtype=f32 {
  config {"hidden": 8, "name": "a # not a comment"}
  param embed: f32[16, 8] from ["model.embed_tokens.weight"]
  param decoder.norm: f32[8] from ["model.layers.{i}.norm.weight"] {block="decoder"}
  param decoder.wqk: f32[8, 8] from ["q.{i}", "k.{i}"] {block="decoder", quant={"scheme": "fp8"}}
  block decoder = decoder x 2
  graph entry {
    %tokens = input "tokens" : i32[T]
    %embed = param "embed" : f32[16, 8]
    %h0 = embedding(%tokens, %embed) : f32[T, 8]
    %h = block(%h0) {block="decoder"} : f32[T, 8]
    return %h
  }
  graph decoder {
    %h = input "h" : f32[T, 8]
    %w = param "decoder.norm" {kernel="inline"} : f32[8]
    %x = rms_norm(%h, %w) {eps=1e-05, kernel="cpu.rms_norm"} : f32[T, 8]
    return %x
  }
}
"""


def test_graph_round_trip():
    text = print_graph(parse_graph(GRAPH))
    assert text == GRAPH.strip()
    assert print_graph(parse_graph(text)) == text


def test_program_round_trip_keeps_params_blocks_and_extra_attrs_on_params():
    program = parse_program(PROGRAM)
    text = print_program(program)
    assert text == PROGRAM.lstrip()
    again = parse_program(text)
    assert dict(again.params) == dict(program.params)
    assert again.params["decoder.wqk"].source == ("q.{i}", "k.{i}")
    assert again.graphs["decoder"].node("w").attrs["kernel"] == "inline"
    assert print_program(again) == text


def test_comments_are_ignored_outside_strings():
    text = GRAPH.replace("%q = linear(%x, %wq) : f32[T, 8]", "%q = linear(%x, %wq) : f32[T, 8]  # q projection")
    assert graphs_equal(parse_graph("# before\n" + text), parse_graph(GRAPH))
    prog = parse_program(PROGRAM.replace("block decoder = decoder x 2", "block decoder = decoder x 2  # layers"))
    assert prog.config["name"] == "a # not a comment" and prog.blocks["decoder"].count == 2


def test_bad_line_is_a_parse_error():
    with pytest.raises(IRParseError):
        parse_graph("graph g {\n  %x = input : f32[4]\n  return %x\n}")


def test_graphs_equal_up_to_renaming():
    renamed = GRAPH
    for old, new in (("%x", "%normed"), ("%q3", "%heads"), ("%t", "%fused")):
        renamed = renamed.replace(old + " ", new + " ").replace(old + ",", new + ",").replace(old + ")", new + ")")
    assert "%normed" in renamed
    assert graphs_equal(parse_graph(renamed), parse_graph(GRAPH))


@pytest.mark.parametrize("change", [
    ("{eps=1e-05} : f32[T, 8]\n  %wq", "{eps=1e-06} : f32[T, 8]\n  %wq"),  # an attribute
    ("%n = getitem(%t) {index=0}", "%n = getitem(%t) {index=1}"),  # an attribute that selects a value
    ("%x = rms_norm(%h, %w)", "%x = add(%h, %h)"),  # an op (and wiring)
    ("add_rms_norm(%h, %x, %w)", "add_rms_norm(%x, %h, %w)"),  # wiring: operand order
    ("return %n, %r", "return %r, %n"),  # output order
    ('param "decoder.wq"', 'param "decoder.wk"'),  # which param is read
])
def test_graphs_differ(change):
    old, new = change
    assert old in GRAPH
    assert not graphs_equal(parse_graph(GRAPH.replace(old, new)), parse_graph(GRAPH))
