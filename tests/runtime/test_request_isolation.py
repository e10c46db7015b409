"""A request can only hurt itself: out-of-range sampling values are refused when the request is added, and a
failure that one request's values or logits cause during a step (sampling, the forward pass, non-finite
logits, stop checks) fails that request alone. The others finish with the tokens they get without it
(greedy and seeded requests, so the tokens do not depend on the batch), and every KV block comes back."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from kiln.runtime import RequestError, SamplingParams
from kiln.runtime.llm_engine import LLMEngine
from safetensors.torch import load_file
from standin_artifact import resave_weights

PROMPTS = ["The quick brown fox", "Once upon a time there was a small kiln", "héllo wörld",
           "Paged attention stores keys and values in fixed size blocks."]


def _requests(tok) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Requests by the step they arrive at: greedy, seeded sampling, n=2, and "bad" arriving mid-run."""
    ids = [tok.encode(p) for p in PROMPTS]
    return {
        0: [("g0", ids[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
            ("g1", ids[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)),
            ("s0", ids[2], SamplingParams(temperature=0.9, top_k=20, max_tokens=10, seed=3, ignore_eos=True)),
            ("n2", ids[3], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=11, ignore_eos=True))],
        2: [("bad", ids[1][:-2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))],
    }


def _drive(engine: LLMEngine, arrivals: dict, skip: str | None = None) -> dict:
    finals = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, ids, params in arrivals.get(step, []):
            if request_id != skip:
                engine.add_request(request_id, ids, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests, "KV blocks or requests left behind"
    bm.check_invariants([])
    return finals


def _tokens(finals: dict) -> dict[str, list[list[int]]]:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in finals.items()}


def _hits(seqs, request_id: str = "bad") -> bool:
    return any(s.request_id == request_id for s in seqs)


@pytest.fixture(scope="module")
def reference(artifact_dir) -> dict[bool, dict]:
    """The good requests' tokens without "bad", per async_scheduling."""
    out = {}
    for overlap in (False, True):
        engine = LLMEngine(artifact_dir, num_kv_blocks=128, async_scheduling=overlap)
        out[overlap] = _tokens(_drive(engine, _requests(engine.tokenizer), skip="bad"))
    return out


@pytest.mark.parametrize("kwargs", [
    {"top_k": 2**63}, {"seed": 2**64}, {"seed": -2**63 - 1}, {"max_tokens": 2**63}, {"logprobs": 2**63},
    {"n": 2**63}, {"stop_token_ids": [2**63]}, {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300},
    {"temperature": 1e39}, {"temperature": float("inf")}, {"top_p": float("nan")}, {"min_p": float("nan")},
    {"frequency_penalty": float("-inf")}, {"presence_penalty": 10**400}, {"stop": ["x"] * 33},
    {"stop": ["x" * 513]},
], ids=lambda kw: "-".join(f"{k}={v!r:.12}" for k, v in kw.items()))
def test_sampling_values_are_bounded_to_what_the_sampler_holds(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(RequestError, match=f"^{name}"):
        SamplingParams(**kwargs)


def test_add_request_checks_the_params_again(artifact_dir):
    engine = LLMEngine(artifact_dir, num_kv_blocks=64)
    params = SamplingParams(temperature=1.0)
    params.top_k = 2**63  # changed after construction: never reaches the sampler's int64 tensor
    with pytest.raises(RequestError, match="top_k"):
        engine.add_request("a", [1, 5, 6], params)
    vocab = engine.model_config.vocab_size
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.add_request("b", [1, 5, 6], SamplingParams(stop_token_ids=[3, vocab]))
    assert not engine.requests and not engine.scheduler.has_unfinished()


def _fault_in_sampling(engine: LLMEngine) -> None:
    sampler = engine.sampler
    for name in ("sample", "sample_on_device"):
        original = getattr(sampler, name)

        def faulty(logits, layout, seqs, _original=original):
            if _hits(seqs):
                raise ValueError("injected: Overflow when unpacking long long")
            return _original(logits, layout, seqs)
        setattr(sampler, name, faulty)


def _fault_in_forward(engine: LLMEngine) -> None:
    execute = engine.runner.execute

    def faulty(batch, *patch):
        if _hits(batch.seqs):
            raise RuntimeError("injected: kernel failure")
        return execute(batch, *patch)
    engine.runner.execute = faulty


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
@pytest.mark.parametrize("inject", [_fault_in_sampling, _fault_in_forward], ids=["sampling", "forward"])
def test_a_step_failure_fails_only_the_request_it_hits(artifact_dir, reference, inject, overlap):
    engine = LLMEngine(artifact_dir, num_kv_blocks=128, async_scheduling=overlap)
    inject(engine)
    finals = _drive(engine, _requests(engine.tokenizer))
    bad = finals.pop("bad")
    assert bad.finished and bad.error is not None and "injected" in bad.error
    assert all(c.finish_reason == "error" for c in bad.outputs)
    assert _tokens(finals) == reference[overlap]


def test_a_failure_of_every_request_fails_each_and_the_engine_goes_on(artifact_dir, reference):
    engine = LLMEngine(artifact_dir, num_kv_blocks=128)
    execute = engine.runner.execute

    def broken(batch, *patch):
        raise RuntimeError("injected: device lost")
    engine.runner.execute = broken
    finals = _drive(engine, _requests(engine.tokenizer))
    assert set(finals) == {"g0", "g1", "s0", "n2", "bad"}
    assert all(out.error is not None and "device lost" in out.error for out in finals.values())
    engine.runner.execute = execute
    assert _tokens(_drive(engine, _requests(engine.tokenizer), skip="bad")) == reference[False]


def _nonfinite_rows(engine: LLMEngine, value: float, every: int) -> None:
    """Every `every`-th logit of request "bad"'s rows becomes `value`, as a broken model's would."""
    execute = engine.runner.execute

    def poisoned(batch, *patch):
        logits, layout = execute(batch, *patch)
        with torch.inference_mode():
            for seq, row in zip(batch.seqs, layout.sample_rows):
                if seq.request_id == "bad" and row is not None:
                    logits[row, ::every] = value
        return logits, layout
    engine.runner.execute = poisoned


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
@pytest.mark.parametrize(("value", "every"), [(float("nan"), 7), (float("inf"), 7), (float("-inf"), 1)],
                         ids=["nan", "inf", "all-minus-inf"])
def test_nonfinite_logits_fail_only_their_request(artifact_dir, reference, value, every, overlap):
    engine = LLMEngine(artifact_dir, num_kv_blocks=128, async_scheduling=overlap)
    _nonfinite_rows(engine, value, every)
    finals = _drive(engine, _requests(engine.tokenizer))
    bad = finals.pop("bad")
    assert bad.error is not None and "not finite" in bad.error and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == []  # no token was made up from the broken row
    assert engine.stats()["num_nonfinite_logits"] == 1
    assert _tokens(finals) == reference[overlap]


def test_a_nan_weight_fails_the_requests_that_read_it(artifact_dir, reference, tmp_path: Path):
    """A NaN in one token's embedding row: requests whose prompt holds that token fail with a clear error;
    the others never read the row and are unaffected."""
    engine = LLMEngine(artifact_dir, num_kv_blocks=128)
    arrivals = _requests(engine.tokenizer)
    used = {t for reqs in arrivals.values() for _, ids, _ in reqs for t in ids}
    used |= {t for outs in reference[False].values() for c in outs for t in c}
    poisoned = next(t for t in range(3, engine.model_config.vocab_size) if t not in used)
    art = tmp_path / "nan-art"
    shutil.copytree(artifact_dir, art)
    weights_file = art / "weights" / "rank0" / "model.safetensors"
    weights = load_file(str(weights_file))
    weights["embed"][poisoned] = float("nan")
    resave_weights(art, weights)

    engine = LLMEngine(art, num_kv_blocks=128)
    bad_ids = arrivals[2][0][1]
    arrivals[2] = [("bad", bad_ids[:3] + [poisoned] + bad_ids[3:], arrivals[2][0][2])]
    finals = _drive(engine, arrivals)
    bad = finals.pop("bad")
    assert bad.outputs[0].finish_reason == "error" and "not finite" in bad.error and not bad.outputs[0].token_ids
    assert _tokens(finals) == reference[False]


def test_a_failing_stop_check_fails_only_its_request(artifact_dir, reference):
    engine = LLMEngine(artifact_dir, num_kv_blocks=128)
    arrivals = _requests(engine.tokenizer)
    finals, step = {}, 0
    while step <= 2 or engine.has_unfinished_requests():
        for request_id, ids, params in arrivals.get(step, []):
            engine.add_request(request_id, ids, params)
            if request_id == "bad":
                def broken(tokens):
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                engine.output_processor.requests["bad"].seqs[0].detokenizer.add_tokens = broken
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    bad = finals.pop("bad")
    assert bad.outputs[0].finish_reason == "error" and "injected" in bad.error
    assert _tokens(finals) == reference[False]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampler_marks_nonfinite_rows_only():
    from kiln.runtime.core.batch import LogitsLayout
    from kiln.runtime.core.sampler import NONFINITE_TOKEN, Sampler
    from kiln.runtime.core.sequence import Sequence

    def seq(i: int, **kw) -> Sequence:
        return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1, 2], num_prompt_tokens=2,
                        params=SamplingParams(**kw), max_tokens=4, arrival=i)

    logits = torch.randn(6, 50)
    logits[1, 3] = float("nan")
    logits[3, 0] = float("inf")
    logits[4] = float("-inf")
    logits[5, 1:] = float("-inf")  # masked but for token 0: sampled as usual
    seqs = [seq(0, temperature=0), seq(1, temperature=0), seq(2, temperature=1.0, top_p=0.9, logprobs=2),
            seq(3, temperature=1.0, logprobs=2), seq(4, temperature=0), seq(5, temperature=1.0, repetition_penalty=2.0)]
    out = Sampler().sample(logits, LogitsLayout(sample_rows=list(range(6)), prompt_rows=[None] * 6), seqs)
    assert out.sampled[0] == int(logits[0].argmax()) and out.sampled[1] == NONFINITE_TOKEN
    assert 0 <= out.sampled[2] < 50 and out.sampled[3] == NONFINITE_TOKEN and out.sampled[4] == NONFINITE_TOKEN
    assert out.sampled[5] == 0
    assert out.logprobs[2] is not None and out.logprobs[3] is None


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_a_retried_step_copies_swapped_blocks_once(artifact_dir, overlap):
    """Preemption by swap in a tiny pool, and the first launch after every swap fails: the retry must not copy
    the blocks again (a block swapped out may already hold another sequence's new KV), so every request still
    gets the tokens of a run without failures."""
    cfg = dict(num_kv_blocks=24, preemption="swap", swap_space_bytes=2**20, prefix_cache=None,
               async_scheduling=overlap)
    engine = LLMEngine(artifact_dir, **cfg)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    arrivals = {0: [(f"r{i}", ids[i], params) for i in range(4)]}
    reference = _tokens(_drive(engine, arrivals))
    assert engine.scheduler.num_swapped_out > 0

    engine = LLMEngine(artifact_dir, **cfg)
    swap, forward = engine.runner.swap, engine.runner.model.forward
    swaps = {"pending": False, "failed": 0}

    def counting_swap(batch):
        swaps["pending"] = swaps["pending"] or bool(batch.swap_out or batch.swap_in)
        swap(batch)

    def failing_after_swap(batch, kv_caches):  # fails once the forward pass wrote its KV after a swap
        logits = forward(batch, kv_caches)
        if swaps["pending"]:
            swaps["pending"] = False
            swaps["failed"] += 1
            raise RuntimeError("injected: failure after a swap")
        return logits
    engine.runner.swap, engine.runner.model.forward = counting_swap, failing_after_swap
    finals = _drive(engine, arrivals)
    assert swaps["failed"] > 0
    ok = {rid: t for rid, t in _tokens(finals).items() if finals[rid].error is None}
    assert len(ok) >= 3 and ok == {rid: reference[rid] for rid in ok}
