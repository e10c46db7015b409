"""The reference interpreter equals a hand-written torch computation on a tiny program."""
import torch
import torch.nn.functional as F
from kiln.compiler import parse_program
from kiln.compiler.interpret import interpret

PROGRAM = """
program tiny dtype=f32 {
  config {}
  param embed: f32[10, 4] from ["embed"]
  param decoder.w: f32[4, 4] from ["layers.{i}.w"] {block="decoder"}
  param decoder.g: f32[4] from ["layers.{i}.g"] {block="decoder"}
  param head: f32[10, 4] from ["head"]
  block decoder = decoder x 2
  graph entry {
    %tokens = input "tokens" : i32[T]
    %embed = param "embed" : f32[10, 4]
    %h0 = embedding(%tokens, %embed)
    %h = block(%h0) {block="decoder"}
    %head = param "head" : f32[10, 4]
    %logits = logits(%h, %head)
    return %logits
  }
  graph decoder {
    %h = input "h" : f32[T, 4]
    %g = param "decoder.g" : f32[4]
    %x = rms_norm(%h, %g) {eps=1e-05}
    %w = param "decoder.w" : f32[4, 4]
    %y = linear(%x, %w)
    %a = silu(%y)
    %out = add(%h, %a)
    return %out
  }
}
"""


def test_interpreter_matches_hand_written_torch():
    torch.manual_seed(0)
    w = {"embed": torch.randn(10, 4), "head": torch.randn(10, 4)}
    for i in range(2):
        w[f"decoder.{i}.w"], w[f"decoder.{i}.g"] = torch.randn(4, 4), torch.rand(4) + 0.5
    tokens = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)

    h = w["embed"][tokens.long()]
    for i in range(2):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w[f"decoder.{i}.g"]
        h = h + F.silu(x @ w[f"decoder.{i}.w"].T)
    expected = h @ w["head"].T

    got = interpret(parse_program(PROGRAM), w, tokens)
    assert got.dtype == torch.float32 and got.shape == (5, 10)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
