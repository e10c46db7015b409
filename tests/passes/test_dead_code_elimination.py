"""dead_code_elimination: nodes no output depends on and params no graph reads are removed."""
from kiln.passes.dead_code_elimination import DeadCodeElimination
from pass_testlib import assert_programs_equal, run_pass, typed

BEFORE = """
program p dtype=f32 {
  config {}
  param w: f32[8, 8] from ["w"]
  param unused: f32[8] from ["unused"]
  param dead: f32[8, 8] from ["dead"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %spare = input "spare" : f32[T, 8]
    %w = param "w" : f32[8, 8]
    %dead = param "dead" : f32[8, 8]
    %y = linear(%x, %w)
    %z = linear(%x, %dead)
    %zz = silu(%z)
    return %y
  }
}
"""

EXPECTED = """
program p dtype=f32 {
  config {}
  param w: f32[8, 8] from ["w"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %spare = input "spare" : f32[T, 8]
    %w = param "w" : f32[8, 8]
    %y = linear(%x, %w)
    return %y
  }
}
"""


def test_removes_dead_nodes_and_unread_params_but_keeps_inputs():
    out, ctx = run_pass(DeadCodeElimination(), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert out.entry.inputs == ("x", "spare")
    assert ctx.stats == {"nodes_removed": 3, "params_removed": 2}


def test_nothing_dead_returns_the_same_program():
    before = typed(EXPECTED)
    out, ctx = run_pass(DeadCodeElimination(), before)
    assert out is before
    assert ctx.stats == {"nodes_removed": 0, "params_removed": 0}
