"""The verifier catches broken structure, signatures and types."""
import pytest
from kiln.compiler import VerifyError, parse_program, verify_program

OK = """
program p dtype=f32 {
  config {}
  param w: f32[8, 8] from ["w"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "w" : f32[8, 8]
    %y = linear(%x, %w) : f32[T, 8]
    %z = silu(%y) : f32[T, 8]
    return %z
  }
}
"""


def test_valid_program_passes():
    verify_program(parse_program(OK), require_types=True)


def test_cycle():
    prog = parse_program(OK)
    g = prog.entry
    g.replace("y", g.node("y").with_(inputs=("z", "w")))
    with pytest.raises(VerifyError, match="cycle"):
        verify_program(prog)


def test_unknown_op():
    with pytest.raises(VerifyError, match="unknown op 'relu_squared'"):
        verify_program(parse_program(OK.replace("silu(%y)", "relu_squared(%y)")))


def test_wrong_arity():
    with pytest.raises(VerifyError, match="silu takes 1..1 inputs, got 2"):
        verify_program(parse_program(OK.replace("silu(%y)", "silu(%y, %x)")))


def test_type_that_disagrees_with_inputs():
    with pytest.raises(VerifyError, match=r"%z = silu is typed f32\[T, 4\] but its inputs give f32\[T, 8\]"):
        verify_program(parse_program(OK.replace("silu(%y) : f32[T, 8]", "silu(%y) : f32[T, 4]")))


def test_shape_rule_violation():
    with pytest.raises(VerifyError, match="does not match weight"):
        verify_program(parse_program(OK.replace('%x = input "x" : f32[T, 8]', '%x = input "x" : f32[T, 6]')))


def test_unknown_param():
    with pytest.raises(VerifyError, match="unknown param 'w_missing'"):
        verify_program(parse_program(OK.replace('%w = param "w"', '%w = param "w_missing"')))


def test_untyped_node_when_types_are_required():
    prog = parse_program(OK.replace("silu(%y) : f32[T, 8]", "silu(%y)"))
    verify_program(prog)
    with pytest.raises(VerifyError, match="no inferred type"):
        verify_program(prog, require_types=True)


def test_tuple_read_without_getitem():
    text = OK.replace('param w: f32[8, 8] from ["w"]', 'param w: f32[8, 8] from ["w"]\n  param g: f32[8] from ["g"]')
    text = text.replace("%z = silu(%y) : f32[T, 8]", """%g = param "g" : f32[8]
    %t = add_rms_norm(%y, %y, %g) : (f32[T, 8], f32[T, 8])
    %z = silu(%t) : f32[T, 8]""")
    with pytest.raises(VerifyError, match="reads tuple-valued %t directly; use getitem"):
        verify_program(parse_program(text))
