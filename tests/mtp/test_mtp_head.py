"""DeepSeek-V3 MTP head: declared in the DSL (a named forward), compiled into model.py as `mtp`, its weights
loaded (copies of the embedding / LM head stored once), its KV layer counted, and its logits equal to an
independent torch reference (fp32, 1e-4)."""
from __future__ import annotations

import json

import pytest
import torch
from mtp_testlib import MTPReference

VOCAB = 512


def _prefill_batch(tokens: list[int], block_size: int):
    from kiln.runtime.forward_batch import ForwardBatch

    T = len(tokens)
    blocks = -(-T // block_size)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return ForwardBatch(input_ids=i32(tokens), positions=i32(list(range(T))), query_start_loc=i32([0, T]),
                        seq_lens=i32([T]), block_tables=i32([list(range(blocks))]),
                        slot_mapping=torch.arange(T, dtype=torch.int64), logits_indices=i32(list(range(T))))


def _kiln_mtp_logits(art_dir, tokens: list[int], next_tokens: list[int]) -> torch.Tensor:
    """kiln's MTP logits for one prefill: main forward (hidden states) then the `mtp` method, shifted tokens."""
    from kiln.runtime.artifact import load_artifact

    art = load_artifact(art_dir)
    kv = art.kv_cache_config
    caches = [torch.zeros((8, *kv.shape), dtype=kv.dtype) for _ in range(kv.num_layers)]
    fb = _prefill_batch(tokens, kv.block_size)
    _, hidden = art.model.forward(fb, caches, return_hidden=True)
    fb.input_ids = torch.tensor(next_tokens, dtype=torch.int32)
    logits, h = art.model.mtp(fb, hidden, caches)  # and the layer's hidden state, what chained drafts read
    assert h.shape == hidden.shape
    return logits


@pytest.mark.parametrize("copies", [True, False], ids=["with_copies", "no_copies"])
def test_mtp_logits_match_reference(mtp_artifact, tiny_checkpoint_lib, copies):
    ckpt, art, _ = mtp_artifact(copies)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, VOCAB, (21,), generator=g).tolist()
    tokens, next_tokens = prompt[:-1], prompt[1:]
    ref = MTPReference(ckpt, tiny_checkpoint_lib.load_hf_model(ckpt))(tokens, next_tokens)
    ours = _kiln_mtp_logits(art, tokens, next_tokens)
    assert ours.shape == ref.shape == (len(tokens), VOCAB)
    torch.testing.assert_close(ours.float(), ref, atol=1e-4, rtol=0)
    # the MTP layer's own weights matter: a different layer would give different logits
    assert (ref - ref.mean(0)).abs().max() > 1e-2


@pytest.mark.parametrize("copies", [True, False], ids=["with_copies", "no_copies"])
def test_mtp_weights_stored_once_and_kv_counted(mtp_artifact, copies):
    """Equal copies in layer 3, or none (the DSL's `else` source): either way stored once."""
    ckpt, art, result = mtp_artifact(copies)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["weights"]["aliases"] == {"mtp_embed": "embed", "mtp_head": "lm_head"}
    assert manifest["drafts"] == {"mtp": {"method": "mtp", "first_kv_layer": 3, "num_kv_layers": 1,
                                          "num_hidden": 1, "chains": True}}
    assert manifest["kv_cache"]["num_layers"] == 4  # 3 main layers + the MTP layer
    assert "4 MLA layers" in result.report and "1 for draft head 'mtp'" in result.report
    recipe = (art / "recipe.dsl").read_text()
    assert "nextn=1" in recipe


def test_no_mtp_recipe_option(mtp_artifact):
    ckpt, art, result = mtp_artifact(True, no_mtp=True)
    manifest = json.loads((art / "manifest.json").read_text())
    assert "drafts" not in manifest and manifest["kv_cache"]["num_layers"] == 3
    assert not any(p["name"].startswith("mtp") for p in manifest["params"])
