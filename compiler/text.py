"""The IR's text form: print and parse graphs and programs, and compare graphs structurally.

    graph decoder {
      %h = input "h" : f32[T, 64]
      %w = param "decoder.attn_norm" : f32[64]
      %x = rms_norm(%h, %w) {eps=1e-05} : f32[T, 64]
      return %x
    }

Types after `:` are optional before shape inference (except on `input`/`param`, whose type is their
declaration). Attribute values are JSON (numbers, strings, true/false/null, lists).
"""
from __future__ import annotations

import json
import re
from typing import Any

import networkx as nx
from kiln.compiler.ir import (
    Attrs,
    BlockSpec,
    Graph,
    Node,
    ParamSpec,
    PerLayer,
    Program,
    TensorType,
    TupleType,
    ValueType,
)


class IRParseError(Exception):
    pass


# ---------------------------------------------------------------- printing


def _json(v: Any) -> Any:
    """A JSON-able form of an attribute value: a PerLayer is {"per_layer": [...]}, parsed back by _parse_attrs."""
    if isinstance(v, PerLayer):
        return {"per_layer": [_json(x) for x in v.values]}
    if isinstance(v, Attrs):
        return {k: _json(v[k]) for k in v}
    if isinstance(v, tuple):
        return [_json(x) for x in v]
    return v


def _per_layer_hook(d: dict[str, Any]) -> Any:
    return PerLayer(tuple(d["per_layer"])) if set(d) == {"per_layer"} else d


def _value(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(_json(v), sort_keys=True)


def format_type(t: ValueType) -> str:
    return str(t)


def print_graph(graph: Graph, indent: str = "") -> str:
    lines = [f"{indent}graph {graph.name} {{"]
    for vid, n in graph.items():
        ty = f" : {n.out}" if n.out is not None else ""
        if n.op in ("input", "param"):
            # name and type are the declaration; further attributes (e.g. `kernel`) print like any op's
            extra = ", ".join(f"{k}={_value(n.attrs[k])}" for k in n.attrs if k not in ("name", "type"))
            extra = f" {{{extra}}}" if extra else ""
            lines.append(f"{indent}  %{vid} = {n.op} {json.dumps(n.attrs['name'])}{extra} : {n.attrs['type']}")
            continue
        args = ", ".join(f"%{i}" for i in n.inputs)
        attrs = ", ".join(f"{k}={_value(n.attrs[k])}" for k in n.attrs)
        attrs = f" {{{attrs}}}" if attrs else ""
        lines.append(f"{indent}  %{vid} = {n.op}({args}){attrs}{ty}")
    lines.append(f"{indent}  return " + ", ".join(f"%{o}" for o in graph.outputs))
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def print_program(program: Program) -> str:
    lines = [f"program {program.name} dtype={program.dtype} {{",
             f"  config {json.dumps(dict(program.config), sort_keys=True)}"]
    for p in program.params.values():
        extra = {"block": p.block, "concat_dim": p.concat_dim or None, "quant": p.quant, "sharding": p.sharding,
                 "fallback": list(p.fallback) or None, "offset": p.offset or None,
                 "transposed": p.transposed or None}
        attrs = ", ".join(f"{k}={_value(v)}" for k, v in extra.items() if v is not None)
        attrs = f" {{{attrs}}}" if attrs else ""
        lines.append(f"  param {p.name}: {TensorType(p.shape, p.dtype)} from {json.dumps(list(p.source))}{attrs}")
    for b in program.blocks.values():
        first = f" {{first_layer={b.first_layer}}}" if b.first_layer else ""
        lines.append(f"  block {b.name} = {b.graph} x {b.count}{first}")
    for g in program.graphs.values():
        lines.append(print_graph(g, indent="  "))
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- parsing

_TYPE = re.compile(r"\s*(\w+)\[([^\]]*)\]")


def parse_type(text: str) -> ValueType:
    text = text.strip()
    if text.startswith("("):
        inner = text[1:-1]
        return TupleType(tuple(_parse_tensor_type(m.group(0)) for m in _TYPE.finditer(inner)))
    return _parse_tensor_type(text)


def _parse_tensor_type(text: str) -> TensorType:
    m = _TYPE.fullmatch(text.strip())
    if not m:
        raise IRParseError(f"bad type {text!r}")
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    return TensorType(tuple(int(d) if d.lstrip("-").isdigit() else d for d in dims), m.group(1))


def _parse_attrs(text: str) -> dict[str, Any]:
    dec = json.JSONDecoder(object_hook=_per_layer_hook)
    attrs: dict[str, Any] = {}
    i = 0
    while i < len(text):
        m = re.compile(r"\s*(\w+)\s*=\s*").match(text, i)
        if not m:
            raise IRParseError(f"bad attributes {text!r}")
        value, i = dec.raw_decode(text, m.end())
        attrs[m.group(1)] = value
        m = re.compile(r"\s*,?\s*").match(text, i)
        i = m.end()
    return attrs


_NODE = re.compile(r"%(?P<vid>[\w.]+)\s*=\s*(?P<op>\w+)\s*(?P<rest>.*)")


def _split_type(rest: str) -> tuple[str, str | None]:
    """Splits 'op-args {attrs} : type' at the last top-level ' : '."""
    depth, quote = 0, False
    cut = None
    for i, ch in enumerate(rest):
        if ch == '"' and (i == 0 or rest[i - 1] != "\\"):
            quote = not quote
        elif not quote and ch in "([{":
            depth += 1
        elif not quote and ch in ")]}":
            depth -= 1
        elif not quote and depth == 0 and ch == ":":
            cut = i
    if cut is None:
        return rest.strip(), None
    return rest[:cut].strip(), rest[cut + 1:].strip()


def _parse_node_line(graph: Graph, line: str) -> None:
    m = _NODE.fullmatch(line)
    if not m:
        raise IRParseError(f"cannot parse IR line: {line!r}")
    vid, op, rest = m.group("vid"), m.group("op"), m.group("rest")
    body, ty = _split_type(rest)
    if op in ("input", "param"):
        if ty is None:
            raise IRParseError(f"{op} %{vid} needs a type")
        t = parse_type(ty)
        try:
            name, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            raise IRParseError(f"{op} %{vid} needs a quoted name in {line!r}") from None
        extra = body[end:].strip()
        attrs = _parse_attrs(extra[1:-1]) if extra else {}
        graph.add(vid, Node(op, (), Attrs({**attrs, "name": name, "type": t}), t))
        return
    if not body.startswith("("):
        raise IRParseError(f"expected '(' after op in {line!r}")
    close = body.index(")")
    inputs = tuple(a.strip().lstrip("%") for a in body[1:close].split(",") if a.strip())
    attr_text = body[close + 1:].strip()
    attrs = _parse_attrs(attr_text[1:-1]) if attr_text else {}
    graph.add(vid, Node(op, inputs, Attrs(attrs), parse_type(ty) if ty else None))


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` inside a quoted string is kept)."""
    quote = False
    for i, ch in enumerate(line):
        if ch == '"' and (i == 0 or line[i - 1] != "\\"):
            quote = not quote
        elif ch == "#" and not quote:
            return line[:i].strip()
    return line.strip()


def parse_graph(text: str) -> Graph:
    lines = [_strip_comment(ln) for ln in text.strip().splitlines()]
    lines = [ln for ln in lines if ln]
    m = re.fullmatch(r"graph\s+([\w.]+)\s*\{", lines[0])
    if not m or lines[-1] != "}":
        raise IRParseError("a graph reads 'graph NAME { ... }'")
    graph = Graph(m.group(1))
    for line in lines[1:-1]:
        if line.startswith("return"):
            graph.outputs = tuple(o.strip().lstrip("%") for o in line[len("return"):].split(",") if o.strip())
        else:
            _parse_node_line(graph, line)
    return graph


_PARAM = re.compile(r"param\s+([\w.]+)\s*:\s*(\w+\[[^\]]*\])\s+from\s+(\[.*?\])\s*(\{.*\})?")


def parse_program(text: str) -> Program:
    lines = [ln for ln in (_strip_comment(raw) for raw in text.strip().splitlines()) if ln]
    m = re.fullmatch(r"program\s+(\w+)\s+dtype=(\w+)\s*\{", lines[0].strip())
    if not m:
        raise IRParseError("a program reads 'program NAME dtype=DT { ... }'")
    name, dtype = m.group(1), m.group(2)
    config: dict[str, Any] = {}
    params: dict[str, ParamSpec] = {}
    blocks: dict[str, BlockSpec] = {}
    graphs: dict[str, Graph] = {}
    i = 1
    while i < len(lines) - 1:
        line = lines[i].strip()
        if line.startswith("config "):
            config = json.loads(line[len("config "):])
        elif line.startswith("param "):
            pm = _PARAM.fullmatch(line)
            if not pm:
                raise IRParseError(f"bad param line {line!r}")
            t = _parse_tensor_type(pm.group(2))
            extra = _parse_attrs(pm.group(4)[1:-1]) if pm.group(4) else {}
            params[pm.group(1)] = ParamSpec(
                pm.group(1), tuple(t.shape), t.dtype, tuple(json.loads(pm.group(3))), block=extra.get("block"),
                concat_dim=extra.get("concat_dim", 0),
                quant=Attrs(extra["quant"]) if "quant" in extra else None,
                sharding=Attrs(extra["sharding"]) if "sharding" in extra else None,
                fallback=tuple(extra.get("fallback", ())), offset=float(extra.get("offset", 0.0)),
                transposed=bool(extra.get("transposed", False)))
        elif line.startswith("block "):
            bm = re.fullmatch(r"block\s+(\w+)\s*=\s*(\w+)\s+x\s+(\d+)\s*(\{.*\})?", line)
            if not bm:
                raise IRParseError(f"bad block line {line!r}")
            extra = _parse_attrs(bm.group(4)[1:-1]) if bm.group(4) else {}
            if set(extra) - {"first_layer"}:
                raise IRParseError(f"unknown block attribute in {line!r} (known: first_layer)")
            blocks[bm.group(1)] = BlockSpec(bm.group(1), bm.group(2), int(bm.group(3)),
                                            int(extra.get("first_layer", 0)))
        elif line.startswith("graph "):
            j = i
            while lines[j].strip() != "}":
                j += 1
            g = parse_graph("\n".join(lines[i:j + 1]))
            graphs[g.name] = g
            i = j
        elif line:
            raise IRParseError(f"unexpected line {line!r}")
        i += 1
    return Program(name, config, params, graphs, blocks, dtype)


# ---------------------------------------------------------------- structural comparison


def graphs_equal(a: Graph, b: Graph) -> bool:
    """True when the graphs compute the same thing up to value-id renaming (op, attrs, types, wiring)."""
    if len(a) != len(b) or len(a.outputs) != len(b.outputs):
        return False

    def node_match(x: dict, y: dict) -> bool:
        nx_, ny = x["node"], y["node"]
        return nx_.op == ny.op and nx_.attrs == ny.attrs and nx_.out == ny.out

    def edge_match(x: dict, y: dict) -> bool:
        return x["index"] == y["index"]

    ga, gb = a.g.copy(), b.g.copy()
    for k, o in enumerate(a.outputs):  # outputs are part of the structure
        ga.add_edge(o, ("__out__", k), index=(k,))
        ga.nodes[("__out__", k)]["node"] = Node("__out__")
    for k, o in enumerate(b.outputs):
        gb.add_edge(o, ("__out__", k), index=(k,))
        gb.nodes[("__out__", k)]["node"] = Node("__out__")
    return nx.is_isomorphic(ga, gb, node_match=node_match, edge_match=edge_match)


def assert_graphs_equal(actual: Graph, expected: Graph) -> None:
    if not graphs_equal(actual, expected):
        raise AssertionError("IR differs.\n--- actual\n" + print_graph(actual) + "\n--- expected\n" + print_graph(expected))
