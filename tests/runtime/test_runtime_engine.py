"""End-to-end generation through LLM / LLMEngine on the stand-in artifact."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime import LLM, RequestError, SamplingParams
from kiln.runtime.llm_engine import LLMEngine
from standin_artifact import dense_greedy, dense_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small kiln that baked models",
    "héllo wörld",
    "Paged attention stores keys and values in fixed size blocks. The quick brown fox jumps",
]


def token_lists(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(artifact_dir):
    return LLM(str(artifact_dir))


@pytest.fixture(scope="module")
def greedy_reference(llm):
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def test_greedy_matches_dense_forward(llm, standin_weights, greedy_reference):
    for prompt, got in zip(PROMPTS[:2], greedy_reference):
        ids = llm.get_tokenizer().encode(prompt)
        assert got == dense_greedy(standin_weights, ids, GREEDY.max_tokens)


def test_batch_equals_each_prompt_alone(llm, greedy_reference):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    assert token_lists(outs) == greedy_reference
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_chunked_prefill_gives_same_tokens(artifact_dir, greedy_reference):
    llm = LLM(str(artifact_dir), max_num_batched_tokens=7, chunked_prefill=3, prefix_cache=None)
    assert token_lists(llm.generate(PROMPTS, GREEDY)) == greedy_reference


def test_preemption_under_tiny_pool_gives_same_tokens(artifact_dir, greedy_reference):
    # 40 KV blocks of 4 tokens; the four requests need ~60 together, so the scheduler must preempt.
    llm = LLM(str(artifact_dir), num_kv_blocks=40, prefix_cache=None)
    assert token_lists(llm.generate(PROMPTS * 2, GREEDY)) == greedy_reference * 2
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 40 and not engine.requests
    engine.block_manager.check_invariants([])


def test_prefix_cache_hits_give_same_tokens(artifact_dir, greedy_reference):
    llm = LLM(str(artifact_dir), prefix_cache="radix")
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)
    assert token_lists(first) == token_lists(again) == greedy_reference
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0.3
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_all_blocks_free_after_finish(llm):
    llm.generate(PROMPTS, SamplingParams(max_tokens=5, n=3, seed=1))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.has_unfinished()
    bm.check_invariants([])


def test_seeded_sampling_independent_of_batch(artifact_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = LLM(str(artifact_dir)).generate(PROMPTS[0], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)  # unseeded neighbours
    mixed = LLM(str(artifact_dir), seed=7).generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone
    different = LLM(str(artifact_dir)).generate(PROMPTS[0], SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True))[0].outputs[0].token_ids
    assert different != alone


def test_n_samples_differ_and_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    out = llm.generate(PROMPTS[1], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 3
    assert [tuple(c.token_ids) for c in llm.generate(PROMPTS[1], params)[0].outputs] == samples


def test_top_k_one_equals_greedy(llm, greedy_reference):
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    assert token_lists(llm.generate(PROMPTS, params)) == greedy_reference


def test_max_tokens_and_stop_token_ids(llm, greedy_reference):
    ref = greedy_reference[1]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length" and out.stop_reason is None
    stop_at = max(i for i, t in enumerate(ref) if ref.index(t) == i and i < 8)  # a first occurrence
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[stop_at]],
                                                  ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[stop_at]


def test_stop_string_truncates_text(llm, greedy_reference):
    full = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    text = full.text
    # a stop string that starts mid-output: take two characters from the middle of the decoded text
    start = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    stop = text[start:start + 2]
    first = text.find(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=["@@never@@", stop],
                                                  ignore_eos=True))[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) <= len(full.token_ids)


def test_eos_stops_unless_ignored(artifact_copy, greedy_reference):
    ref = greedy_reference[0]
    eos = ref[3]  # make the 4th greedy token the model's eos
    path = artifact_copy(lambda m: m["runtime"].__setitem__("eos_token_ids", [eos]))
    llm = LLM(str(path))
    stop_at = ref.index(eos)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_logprobs_match_dense_log_softmax(llm, standin_weights):
    tok = llm.get_tokenizer()
    prompt_ids = tok.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
    comp = out.outputs[0]
    full = prompt_ids + comp.token_ids
    ref = torch.log_softmax(dense_logits(standin_weights, full), dim=-1)
    # prompt logprobs: position j scored by the logits at j-1; first entry None
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    for j in range(1, len(prompt_ids)):
        entry = out.prompt_logprobs[j]
        actual = prompt_ids[j]
        assert actual in entry and len(entry) <= 3
        assert entry[actual].logprob == pytest.approx(float(ref[j - 1, actual]), abs=1e-4)
        assert entry[actual].rank == int((ref[j - 1] > ref[j - 1, actual]).sum()) + 1
        top2 = ref[j - 1].topk(2).indices.tolist()
        assert all(t in entry for t in top2)
    assert len(comp.logprobs) == len(comp.token_ids)
    cumulative = 0.0
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt_ids) - 1 + i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == 1  # greedy picks the top token
        for t in row.topk(3).indices.tolist():
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert entry[token].decoded_token == tok.decode([token], skip_special_tokens=False)
        cumulative += float(row[token])
    assert comp.cumulative_logprob == pytest.approx(cumulative, abs=1e-3)


def test_prompt_logprobs_survive_chunking(artifact_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    whole = llm.generate(PROMPTS[3], params)[0].prompt_logprobs
    chunked = LLM(str(artifact_dir), max_num_batched_tokens=5, chunked_prefill=3).generate(
        PROMPTS[3], params)[0].prompt_logprobs
    assert len(whole) == len(chunked)
    for a, b in zip(whole[1:], chunked[1:]):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


def test_abort_frees_blocks(artifact_dir):
    engine = LLMEngine(artifact_dir)
    engine.add_request("a", [1, 5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [1, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    engine.abort_request("nope")  # unknown ids are ignored
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["a"].outputs[0].finish_reason == "abort" and finals["b"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_request_validation(artifact_dir, llm):
    engine = LLMEngine(artifact_dir, num_kv_blocks=8)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("long", list(range(3, 300)), SamplingParams())
    with pytest.raises(RequestError, match="exceeds max_model_len"):
        engine.add_request("long2", [1, 2, 3], SamplingParams(max_tokens=254))
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("big", [1, 2, 3], SamplingParams(max_tokens=40))
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("oov", [1, 10_000], SamplingParams())
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError):
        llm.generate("x" * 600)  # long text prompt through the facade
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": -1}, {"max_tokens": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -0.1}, {"n": 0},
    {"top_k": -2}, {"min_p": 2.0}, {"repetition_penalty": 0.0}, {"presence_penalty": 3.0}, {"logprobs": -1},
    {"stop": [""]}, {"stop": [1]}, {"stop_token_ids": [-1]}, {"max_tokens": 2.5},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_prompt_forms(llm, greedy_reference):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_text, by_ids, by_list = llm.generate(PROMPTS[0], GREEDY), llm.generate(ids, GREEDY), \
        llm.generate([ids, PROMPTS[1]], GREEDY)
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids == by_list[0].outputs[0].token_ids
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids
    assert len(by_list) == 2 and by_list[1].outputs[0].token_ids == greedy_reference[1]
    with pytest.raises(RequestError):
        llm.generate([[1, 2], [], "x"], GREEDY)


def test_penalties_change_output_and_stay_deterministic(llm, greedy_reference):
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, frequency_penalty=1.0,
                            presence_penalty=0.5, ignore_eos=True)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, params)
    assert token_lists(a) == token_lists(b)
    assert token_lists(a) != greedy_reference


@pytest.mark.parametrize("swap_blocks", [64, 3])
def test_swap_preemption_gives_same_tokens(artifact_dir, greedy_reference, swap_blocks):
    # Same tiny pool as the recompute test, preempting by swapping KV blocks to CPU memory. With a swap
    # space of 3 blocks the victims do not fit and fall back to recompute.
    probe = LLM(str(artifact_dir), num_kv_blocks=1, prefix_cache=None)
    block_bytes = probe.engine.artifact.kv_cache_config.bytes_per_block
    llm = LLM(str(artifact_dir), num_kv_blocks=40, prefix_cache=None, preemption="swap",
              swap_space_bytes=swap_blocks * block_bytes)
    assert token_lists(llm.generate(PROMPTS * 2, GREEDY)) == greedy_reference * 2
    engine = llm.engine
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    if swap_blocks == 64:
        assert stats["num_swapped_out"] > 0
    else:
        assert stats["num_preemptions"] > stats["num_swapped_out"]  # fell back to recompute
    assert engine.block_manager.num_free_blocks == 40 and not engine.requests
    assert engine.scheduler.swap_space.num_free_blocks == swap_blocks
    engine.block_manager.check_invariants([])


def test_swapped_request_abort_frees_swap_space(artifact_dir):
    probe = LLM(str(artifact_dir), num_kv_blocks=1, prefix_cache=None)
    block_bytes = probe.engine.artifact.kv_cache_config.bytes_per_block
    llm = LLM(str(artifact_dir), num_kv_blocks=30, prefix_cache=None, preemption="swap",
              swap_space_bytes=64 * block_bytes)
    engine = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tok = llm.get_tokenizer()
    for i, p in enumerate(PROMPTS * 2):
        engine.add_request(str(i), tok.encode(p), params)
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    assert engine.scheduler.swapped, "the tiny pool should have forced a swap-out"
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.step()
    assert engine.scheduler.swap_space.num_free_blocks == 64
    assert engine.block_manager.num_free_blocks == 30 and not engine.scheduler.has_unfinished()
