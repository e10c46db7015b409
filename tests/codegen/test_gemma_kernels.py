"""Gemma's kernels against the op table's torch references (compiler/ops.py) and transformers: gelu_tanh,
scale, softcap (cpu library), and soft-capped paged attention (Gemma 2) in the cpu library and the Triton
kernels (prefill and split-KV decode, under Triton's CPU interpreter), with and without a sliding window."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from kiln.compiler.ops import OPS, RefContext  # noqa: E402
from kiln.runtime.forward_batch import ForwardBatch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import render_kernels  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("gemma_kernels"), head_dim=16, num_heads=4, num_kv_heads=2,
                          block_size=BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_scale_softcap_match_references(K, dtype):
    from transformers.activations import ACT2FN

    R, ctx = K._ref, RefContext(positions=torch.arange(3))
    x = (4 * torch.randn(3, 40, generator=torch.Generator().manual_seed(0))).to(dtype)
    gelu = R.gelu_tanh(x)
    assert torch.equal(gelu, ACT2FN["gelu_pytorch_tanh"](x)) and torch.equal(gelu, OPS["gelu_tanh"].reference(ctx, x))
    assert not torch.allclose(gelu.float(), torch.nn.functional.gelu(x.float()), atol=1e-4)  # not the erf GELU
    # HF Gemma: embeddings * torch.tensor(hidden ** 0.5).to(weight.dtype)
    assert torch.equal(R.scale(x, 2304 ** 0.5), x * torch.tensor(2304 ** 0.5).to(dtype))
    assert torch.equal(R.scale(x, 48.0), OPS["scale"].reference(ctx, x, factor=48.0))
    capped = R.softcap(x.float(), 3.0)
    torch.testing.assert_close(capped, OPS["softcap"].reference(ctx, x.float(), cap=3.0), rtol=0, atol=0)
    assert capped.abs().max() < 3.0 < x.float().abs().max()


def _paged(q, k, v, new: int, perm: torch.Tensor):
    """One sequence of q/k/v [S, heads, D] whose first S - new tokens are cached, in the shuffled physical blocks
    `perm`: the kernel inputs (new tokens' q/k/v, the cache, the batch)."""
    S, kvh, d = k.shape
    table = perm[: -(-S // BLOCK)].to(torch.int32)
    slots = table.long()[torch.arange(S) // BLOCK] * BLOCK + torch.arange(S) % BLOCK
    cache = torch.zeros(len(perm), 2, BLOCK, kvh, d)
    for p in range(S - new):
        cache[slots[p] // BLOCK, 0, slots[p] % BLOCK] = k[p]
        cache[slots[p] // BLOCK, 1, slots[p] % BLOCK] = v[p]
    batch = ForwardBatch(
        input_ids=torch.zeros(new, dtype=torch.int32), positions=torch.arange(S - new, S, dtype=torch.int32),
        query_start_loc=torch.tensor([0, new], dtype=torch.int32), seq_lens=torch.tensor([S], dtype=torch.int32),
        block_tables=table[None], slot_mapping=slots[S - new:],
        logits_indices=torch.tensor([new - 1], dtype=torch.int32), num_decodes=int(new == 1))
    return q[S - new:], k[S - new:], v[S - new:], cache, batch


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("new", [13, 1], ids=["prefill", "decode"])
def test_softcapped_paged_attention_matches_reference(K, window, new, monkeypatch):
    g = torch.Generator().manual_seed(window + new)
    S, scale, cap = 13, 16 ** -0.5, 5.0
    q, k, v = (3 * torch.randn(S, h, 16, generator=g) for h in (4, 2, 2))  # large scores: the cap bites
    ref = OPS["attention"].reference(RefContext(positions=torch.arange(S)), q, k, v, scale=scale,
                                     sliding_window=window, softcap=cap)[S - new:]
    uncapped = OPS["attention"].reference(RefContext(positions=torch.arange(S)), q, k, v, scale=scale,
                                          sliding_window=window)[S - new:]
    assert not torch.allclose(ref, uncapped, atol=1e-3)
    perm = torch.randperm(6, generator=g)
    qn, kn, vn, cache, batch = _paged(q, k, v, new, perm)
    out = K._ref.paged_attention(qn, kn, vn, cache, batch, scale, sliding_window=window, softcap=cap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    monkeypatch.setattr(K._ref, "paged_attention", None)  # the Triton kernels, never their torch fallback
    qn, kn, vn, cache, batch = _paged(q, k, v, new, perm)
    out = K.paged_attention(qn, kn, vn, cache, batch, scale, sliding_window=window, softcap=cap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
