"""Async scheduling (LLMEngine(async_scheduling=True)) forced on over the CPU stand-in artifact: the engine
launches step N+1 before reading step N back, so every output must still equal the synchronous engine's.

The reference is the same engine with async scheduling off, driven through the same arrivals and aborts. A
slip in the device-side input ids (the placeholder is -1, which the stand-in's embedding would read as the last
row), in dropping the extra token of a sequence found finished late, or in freeing its KV shows up as a
different token, text, finish reason, or a leaked block.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.errors import ArtifactError
from kiln.runtime.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small kiln",
    "héllo wörld",
    "Paged attention stores keys and values in fixed size blocks.",
]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _stop_choices(artifact_dir: Path) -> tuple[str, int]:
    """A stop string and a stop token id that do occur mid-output (from a synchronous greedy run)."""
    llm = LLM(str(artifact_dir), num_kv_blocks=64, async_scheduling=False)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    text, ids = out.text, out.token_ids
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    stop_id = next(t for i, t in enumerate(ids) if ids.index(t) == i and i >= 4)  # a first occurrence
    return text[start:start + 2], stop_id


def _arrivals(tok, stop_string: str, stop_id: int) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Requests by the step they arrive at: different max_tokens, stops, seeded sampling, n=2, an abort
    victim, a repeated prompt (prefix-cache hits), and requests that force synchronous steps."""
    ids = [tok.encode(p) for p in PROMPTS]
    return {
        0: [("g0", ids[3], SamplingParams(max_tokens=12, **GREEDY)),
            ("g1", ids[1], SamplingParams(max_tokens=5, **GREEDY)),
            ("s0", ids[2], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True))],
        2: [("stop_str", ids[0], SamplingParams(max_tokens=12, stop=[stop_string], **GREEDY)),
            ("stop_id", ids[0], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY)),
            ("n2", ids[1], SamplingParams(n=2, temperature=1.0, top_k=20, max_tokens=8, seed=11, ignore_eos=True))],
        4: [("abort", ids[2], SamplingParams(max_tokens=30, **GREEDY))],
        5: [("lp", ids[0], SamplingParams(max_tokens=4, logprobs=2, **GREEDY)),  # synchronous steps
            ("pen", ids[2], SamplingParams(max_tokens=4, repetition_penalty=1.3, **GREEDY))],
        7: [("late", ids[3], SamplingParams(max_tokens=6, **GREEDY)),
            ("late_s", ids[0], SamplingParams(temperature=0.7, max_tokens=7, seed=5, ignore_eos=True))],
    }


def _drive(engine: LLMEngine, arrivals: dict, abort_at: dict[str, int]) -> tuple[dict, dict, int]:
    """Steps `engine` through `arrivals`; aborts request r once an output shows `abort_at[r]` tokens.
    Returns the final outputs, the last output seen before each abort, and how many steps were left in
    flight (overlapped) when `step()` returned."""
    finals, before_abort, overlapped, step = {}, {}, 0, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, ids, params in arrivals.get(step, []):
            engine.add_request(rid, ids, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
            elif out.request_id in abort_at and len(out.outputs[0].token_ids) >= abort_at[out.request_id]:
                before_abort[out.request_id] = out
                engine.abort_request(out.request_id)
        overlapped += engine._inflight is not None and bool(engine._inflight.seqs)
        step += 1
        assert step < 500, "engine did not finish"
    return finals, before_abort, overlapped


def _summary(out) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs is not None) for c in out.outputs]


CONFIGS = {
    "default": {"num_kv_blocks": 512},
    "tiny_pool_recompute": {"num_kv_blocks": 36, "prefix_cache": None},
    "tiny_pool_swap": {"num_kv_blocks": 36, "prefix_cache": None, "preemption": "swap"},
    "chunked_prefill": {"max_num_batched_tokens": 16, "chunked_prefill": 5},
}


@pytest.fixture(scope="module")
def stops(artifact_dir):
    return _stop_choices(artifact_dir)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_async_outputs_equal_synchronous(artifact_dir, stops, config):
    kwargs = dict(CONFIGS[config])
    if kwargs.get("preemption") == "swap":
        probe = LLMEngine(artifact_dir, num_kv_blocks=1)
        kwargs["swap_space_bytes"] = 64 * probe.artifact.kv_cache_config.bytes_per_block
    results = {}
    for mode in (False, True):
        engine = LLMEngine(artifact_dir, async_scheduling=mode, **kwargs)
        assert engine.async_scheduling is mode
        arrivals = _arrivals(engine.tokenizer, *stops)
        finals, before_abort, overlapped = _drive(engine, arrivals, {"abort": 3})
        expected = {rid for reqs in arrivals.values() for rid, _, _ in reqs}
        assert set(finals) == expected
        # the abort's final output holds exactly the tokens already shown (the one in flight is dropped)
        aborted = finals["abort"].outputs[0]
        assert aborted.finish_reason == "abort"
        assert aborted.token_ids == before_abort["abort"].outputs[0].token_ids
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not engine.requests
        bm.check_invariants([])
        if engine.scheduler.swap_space is not None:
            assert engine.scheduler.swap_space.num_free_blocks == 64
        stats = engine.stats()
        if config.startswith("tiny_pool"):
            assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
        if config == "tiny_pool_swap":
            assert stats["num_swapped_out"] > 0
        if config == "default":
            assert stats["prefix_cache_hits"] > 0
        if mode:
            assert overlapped >= 5, f"only {overlapped} steps overlapped"
        else:
            assert overlapped == 0
        results[mode] = {rid: _summary(out) for rid, out in finals.items()}
    sync, overlapped_run = results[False], results[True]
    # An async step() that reads back step N and then has to run N+1 synchronously (here: the logprobs and
    # penalty requests) returns both steps' tokens at once, so the client may see the abort victim one token
    # later; what it was shown is the same greedy continuation.
    (sync_abort, *_), = sync.pop("abort")
    (async_abort, *_), = overlapped_run.pop("abort")
    assert len(sync_abort) == 3 and async_abort[:3] == sync_abort and len(async_abort) <= 4
    assert overlapped_run == sync
    # the stops did fire, so the comparison covers them
    assert sync["stop_str"][0][2:4] == ("stop", stops[0]) and sync["stop_id"][0][2:4] == ("stop", stops[1])
    assert [c[2] for c in sync["g1"]] == ["length"] and len(sync["g1"][0][0]) == 5
    assert len(sync["n2"]) == 2 and sync["n2"][0][0] != sync["n2"][1][0]


def test_switch_defaults_and_manifest(artifact_copy):
    path = artifact_copy()
    assert LLMEngine(path, num_kv_blocks=64).async_scheduling is False  # CPU: torch is synchronous anyway
    assert LLMEngine(path, num_kv_blocks=64, async_scheduling=True).async_scheduling is True

    def set_flag(value) -> None:  # the recipe's `scheduler { async_scheduling = true }` reaches the manifest
        manifest = json.loads((path / "manifest.json").read_text())
        manifest.setdefault("scheduler", {})["async_scheduling"] = value
        (path / "manifest.json").write_text(json.dumps(manifest))

    set_flag("true")
    assert LLMEngine(path, num_kv_blocks=64).async_scheduling is True
    assert LLMEngine(path, num_kv_blocks=64, async_scheduling=False).async_scheduling is False
    set_flag(False)
    assert LLMEngine(path, num_kv_blocks=64).async_scheduling is False
    set_flag("sometimes")
    with pytest.raises(ArtifactError, match="async_scheduling"):
        LLMEngine(path, num_kv_blocks=64)


def test_switching_off_mid_run_reads_back_the_step_in_flight(artifact_dir):
    ids = [1, 5, 6, 7, 8]
    sync = LLMEngine(artifact_dir, num_kv_blocks=64, async_scheduling=False)
    sync.add_request("r", ids, SamplingParams(max_tokens=9, **GREEDY))
    while sync.has_unfinished_requests():
        final = sync.step()
    engine = LLMEngine(artifact_dir, num_kv_blocks=64, async_scheduling=True)
    engine.add_request("r", ids, SamplingParams(max_tokens=9, **GREEDY))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    engine.async_scheduling = False
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        assert engine._inflight is None
    assert outs[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_cli_flag():
    from kiln.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "art"]).async_scheduling is None
    assert parse(["serve", "art", "--async-scheduling"]).async_scheduling is True
    assert parse(["serve", "art", "--no-async-scheduling"]).async_scheduling is False


def test_server_with_async_scheduling(artifact_dir):
    from live_server import MODEL, LiveServer

    prompt, params = PROMPTS[1], SamplingParams(max_tokens=10, **GREEDY)
    expected = LLM(str(artifact_dir), num_kv_blocks=64, async_scheduling=False).generate(prompt, params)[0].outputs[0].text
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256, "async_scheduling": True})
    try:
        assert server.in_engine(lambda e: e.async_scheduling) is True
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=30) as client:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
            streamed = []
            with client.stream("POST", "/v1/completions", json={**body, "stream": True, "n": 2}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for choice in json.loads(line[6:])["choices"]:
                            streamed.append((choice["index"], choice["text"]))
        for index in (0, 1):
            assert "".join(t for i, t in streamed if i == index) == expected
        server.wait_idle()
    finally:
        server.stop()


def test_recipe_option(tmp_path):
    from kiln.dsl import SourceError, load_recipe

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dsl"))
    from test_dsl_errors import MODEL

    def recipe(value: str) -> Path:
        path = tmp_path / f"r_{value}.dsl"
        path.write_text(MODEL + "recipe r {\n  model = tiny(vocab=1, hidden=2)\n"
                        f"  scheduler {{ max_seqs = 8; async_scheduling = {value} }}\n}}\n")
        return path

    from kiln.compiler.options import recipe_options  # the recipe's sections are the compiler's options

    assert recipe_options(load_recipe(str(recipe("false"))).recipe).scheduler.async_scheduling is False
    with pytest.raises(SourceError, match="'async_scheduling' must be true or false"):
        recipe_options(load_recipe(str(recipe("3"))).recipe)
