"""The rewrite-as-data helper (compiler/rewrite.py): pattern matching, guards, the driver's bookkeeping and its
index of rules by root op."""
import sys
from pathlib import Path

from kiln.compiler import ParamSpec, Pass, PassContext
from kiln.compiler.rewrite import P, Rewrite, V, apply_rewrites, match

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
from pass_testlib import assert_programs_equal, run_pass, typed  # noqa: E402

TEXT = """
program p dtype=f32 {
  config {}
  graph entry {
    %x = input "x" : f32[T, 8]
    %y = input "y" : f32[T, 8]
    %a = add(%x, %x)
    %b = add(%x, %y)
    %c = mul(%b, %a)
    return %c
  }
}
"""


def test_a_name_bound_twice_must_bind_the_same_value():
    prog = typed(TEXT)
    same = P("add", V("u"), V("u"))
    assert match(same, prog.entry, prog, "a") is not None
    assert match(same, prog.entry, prog, "b") is None
    m = match(P("add", V("u"), V("w")), prog.entry, prog, "b")
    assert (m["u"], m["w"], m.nodes) == ("x", "y", ("b",))


def test_commutative_patterns_try_both_orders():
    prog = typed(TEXT)
    doubled_first = P("mul", P("add", V("u"), V("u"), name="d"), V("rest"))
    assert match(doubled_first, prog.entry, prog, "c") is None
    m = match(P("mul", P("add", V("u"), V("u"), name="d"), V("rest"), commutative=True), prog.entry, prog, "c")
    assert (m["d"], m["rest"]) == ("a", "b")


def test_through_walks_back_along_first_inputs():
    prog = typed(TEXT.replace("%c = mul(%b, %a)", "%s = silu(%b)\n    %c = silu(%s)"))
    m = match(P("add", V("u"), V("w"), name="sum", through=("silu",)), prog.entry, prog, "c")
    assert m["sum"] == "b" and m.nodes == ("c", "s", "b")


class _AddToMul(Pass):
    name = "add_to_mul"
    # add(u, w) -> mul(u, w), but only when u and w differ
    REWRITES = (Rewrite("add_to_mul", P("add", V("u"), V("w")),
                        replace=lambda m, b: b.add("mul", (m["u"], m["w"]), hint=m.root),
                        extra_check=lambda m: m["u"] != m["w"]),)

    def run(self, program, ctx):
        return apply_rewrites(program, self.REWRITES, ctx)


def test_driver_replaces_counts_and_keeps_value_ids():
    out, ctx = run_pass(_AddToMul(), typed(TEXT))
    assert_programs_equal(out, typed(TEXT.replace("%b = add(%x, %y)", "%b = mul(%x, %y)")))
    assert ctx.stats == {"matches": 1, "by_rewrite": {"add_to_mul": 1}}
    assert out.entry.order() == ["x", "y", "a", "b", "c"]  # the replacement took %b's place and name


def test_guard_or_declining_replacement_leaves_the_program_alone():
    prog = typed(TEXT.replace("%b = add(%x, %y)", "%b = add(%y, %y)"))
    out, ctx = run_pass(_AddToMul(), prog)
    assert out is prog and ctx.stats["matches"] == 0
    declining = Rewrite("never", P("add", V("u"), V("w")), replace=lambda m, b: None)
    assert apply_rewrites(prog, [declining], PassContext()) is prog


def test_new_param_names_never_collide():
    text = """
program p dtype=f32 {
  config {}
  param w: f32[8, 8] from ["w"]
  param w2: f32[8, 8] from ["w2"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "w" : f32[8, 8]
    %y = linear(%x, %w)
    return %y
  }
}
"""
    # linear(x, w) -> linear(x, w') where w' is a new param that asks for the taken name "w2"
    rw = Rewrite("swap_weight", P("linear", V("x"), P("param", name="w")),
                 replace=lambda m, b: b.add("linear", (m["x"], b.add_param(ParamSpec("w2", (8, 8), "f32", ("fresh",)),
                                                                             after="w")), hint=m.root),
                 extra_check=lambda m: m.param("w").name == "w")
    out = apply_rewrites(typed(text), [rw], PassContext())
    assert list(out.params) == ["w2_1", "w2"] and out.params["w2_1"].source == ("fresh",)
    assert out.entry.node("y").inputs == ("x", "w2_1")


def test_rules_are_indexed_by_the_op_at_their_root():
    """A node is tried only against the rules whose pattern can be rooted at its op, in table order."""
    from kiln.compiler.rewrite import RuleIndex, root_ops

    mul = Rewrite("mul_rule", P("mul", V("a"), V("b")), replace=lambda m, b: None)
    either = Rewrite("either", P(("add", "mul"), V("a"), V("b")), replace=lambda m, b: None)
    through = Rewrite("through", P("attention", name="att", through=("view", "rope")), replace=lambda m, b: None)
    anything = Rewrite("anything", V("x"), replace=lambda m, b: None)
    assert root_ops(mul.pattern) == {"mul"} and root_ops(anything.pattern) is None
    assert root_ops(through.pattern) == {"attention", "view", "rope"}
    index = RuleIndex([mul, either, through, anything])
    assert [r.name for r in index.for_op("mul")] == ["mul_rule", "either", "anything"]
    assert [r.name for r in index.for_op("add")] == ["either", "anything"]
    assert [r.name for r in index.for_op("rope")] == ["through", "anything"]
    assert [r.name for r in index.for_op("linear")] == ["anything"]


def test_the_driver_matches_only_the_indexed_rules(monkeypatch):
    """apply_rewrites calls the matcher for (node, rule) pairs of the index only: not every rule at every node."""
    import kiln.compiler.rewrite as rw

    program = typed(TEXT)
    calls = []
    real = rw.match
    monkeypatch.setattr(rw, "match", lambda p, g, prog, vid, params=None: calls.append((g.node(vid).op, p.op))
                        or real(p, g, prog, vid, params))
    rules = [Rewrite("on_mul", P("mul", V("a"), V("b")), replace=lambda m, b: None),
             Rewrite("on_relu", P("relu", V("a")), replace=lambda m, b: None)]
    apply_rewrites(program, rules, PassContext())
    assert calls and all(op == pat for op, pat in calls)
