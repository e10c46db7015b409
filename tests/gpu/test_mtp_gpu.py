"""DeepSeek-V3 MTP on an H200 artifact: the MTP head's logits against the independent torch reference, and
greedy speculative decoding equal to plain greedy decoding (fp32 artifact, CUDA). Not yet run on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mtp"))
from mtp_testlib import MTPReference, add_mtp_layer  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def h200_mtp(tiny_checkpoint_lib, tmp_path_factory):
    import kiln
    from kiln.cli import main

    work = tmp_path_factory.mktemp("mtp_gpu")
    ckpt = tiny_checkpoint_lib.build_tiny_checkpoint(work / "ckpt", "deepseek_v3")
    add_mtp_layer(ckpt, repeat_head=True)
    recipe = work / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "--target", "h200", "--dtype", "fp32", "-o", str(recipe)]) == 0
    kiln.compile(recipe, work / "art", progress=False)
    return ckpt, work / "art"


def test_mtp_logits_on_gpu_match_reference(h200_mtp, tiny_checkpoint_lib):
    from kiln.runtime.artifact import load_artifact
    from kiln.runtime.forward_batch import ForwardBatch

    ckpt, art_dir = h200_mtp
    prompt = torch.randint(5, VOCAB, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens, next_tokens = prompt[:-1], prompt[1:]
    ref = MTPReference(ckpt, tiny_checkpoint_lib.load_hf_model(ckpt))(tokens, next_tokens)
    art = load_artifact(art_dir, "cuda")
    kv = art.kv_cache_config
    caches = [torch.zeros((8, *kv.shape), dtype=kv.dtype, device="cuda") for _ in range(kv.num_layers)]
    T = len(tokens)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    fb = ForwardBatch(input_ids=i32(tokens), positions=i32(list(range(T))), query_start_loc=i32([0, T]),
                      seq_lens=i32([T]), block_tables=i32([list(range(-(-T // kv.block_size)))]),
                      slot_mapping=torch.arange(T, dtype=torch.int64, device="cuda"), logits_indices=i32(list(range(T))))
    _, hidden = art.model.forward(fb, caches, return_hidden=True)
    fb.input_ids = i32(next_tokens)
    logits, _ = art.model.mtp(fb, hidden, caches)  # and its hidden state, for chained drafts
    torch.testing.assert_close(logits.float().cpu(), ref, atol=1e-3, rtol=0)


def test_speculative_greedy_equals_plain_on_gpu(h200_mtp):
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    _, art = h200_mtp
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 30, 9)]
    outs = []
    for spec in (None, "mtp"):
        engine = LLMEngine(art, device="cuda", speculative=spec, num_kv_blocks=64)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outs.append(done)
    assert outs[0] == outs[1]
    assert engine.stats()["spec_num_accepted_tokens"] > 0
