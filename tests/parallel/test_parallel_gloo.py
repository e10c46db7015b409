"""Parallel artifacts served by rank worker processes over torch.distributed gloo (the default executor).

`kiln.LLM` / `kiln serve` on a tp/ep/dp artifact spawn one worker per rank > 0 (`python -m
kiln.runtime.worker.distributed.worker`), each loading only weights/rank{r}/. Checked against the single-device
artifact of the same checkpoint: fp32 prompt logprobs within 1e-4 and 32 greedy tokens identical; two runs
bit-identical; a rank that dies or hangs fails the requests in flight within a bound and nothing is left running.
Every process a test starts is stopped in `finally`.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from kiln.runtime.worker.interface import ExecutorError

import kiln

PROMPTS = [[7, 8, 9, 10, 11], list(range(40, 57)), [300, 5, 77, 120, 410, 9, 33, 64, 200, 15, 6, 18]]


def _params(n: int = 32) -> kiln.SamplingParams:
    return kiln.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


def _run(art, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, prompt logprobs) per prompt; the LLM (and its workers) closed before returning."""
    with kiln.LLM(str(art), num_kv_blocks=64) as llm:
        outs = llm.generate(prompts, _params())
    return [(o.outputs[0].token_ids, [o.prompt_logprobs[j][t].logprob for j, t in enumerate(p) if j > 0])
            for o, p in zip(outs, prompts, strict=True)]


def assert_same_outputs(got, want) -> None:
    for (tokens, lp), (ref_tokens, ref_lp) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref_lp), atol=1e-4, rtol=0)


def _workers_of(pid: int) -> list[int]:
    """The rank worker processes spawned by process `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"kiln.runtime.worker.distributed.worker" in cmd:
            out.append(int(entry))
    return sorted(out)


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_gloo_mesh_matches_single_device(compile_parallel):
    """DeepSeek-V3-style MLA + MoE with data-parallel attention and expert-parallel MoE: every collective kind
    (vocab-parallel embedding's all_reduce, dp_gather/dp_scatter around the experts, the logits rows' gather)
    over gloo. Every other family's placement runs on the single-process mesh (test_parallel_parity.py)."""
    _, single = compile_parallel("deepseek_v3", None)
    _, art = compile_parallel("deepseek_v3", "dp = 2; ep = 2")
    want = _run(single)
    llm = kiln.LLM(str(art), num_kv_blocks=64)
    try:
        outs = llm.generate(PROMPTS, _params())
        assert_same_outputs([(o.outputs[0].token_ids, [o.prompt_logprobs[j][t].logprob for j, t in enumerate(p)
                                                        if j > 0]) for o, p in zip(outs, PROMPTS, strict=True)], want)
        # rank 1 dies while the mesh idles: the executor says so at once (a server stops without a request)
        executor, failures = llm.engine.runner, []
        executor.on_failure(failures.append)
        pids = executor.worker_pids
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "exited" in failures[0]
        with pytest.raises(ExecutorError):
            llm.generate([PROMPTS[0]], _params(2))
    finally:
        llm.close()
    assert _gone(pids)


def test_two_gloo_runs_are_bit_identical_and_a_hung_rank_fails_within_the_timeout(compile_parallel, monkeypatch):
    _, art = compile_parallel("llama", "tp = 2")
    first = _run(art)
    monkeypatch.setenv("KILN_DIST_TIMEOUT", "3")
    llm = kiln.LLM(str(art), num_kv_blocks=64)
    try:
        pids = llm.engine.runner.worker_pids
        assert pids == _workers_of(os.getpid())
        outs = llm.generate(PROMPTS, _params())
        again = [(o.outputs[0].token_ids, [o.prompt_logprobs[j][t].logprob for j, t in enumerate(p) if j > 0])
                 for o, p in zip(outs, PROMPTS, strict=True)]
        assert again == first  # bit-identical: same shards, same reduction order
        os.kill(pids[0], signal.SIGSTOP)  # rank 1 hangs: rank 0's next collective times out
        start = time.monotonic()
        with pytest.raises(ExecutorError, match="cannot run"):
            llm.generate([PROMPTS[0]], _params(4))
        assert time.monotonic() - start < 3 + 10
        with pytest.raises(ExecutorError):  # and stays failed: no later call waits again
            llm.generate([PROMPTS[0]], _params(4))
    finally:
        llm.close()
    assert _gone(pids), "a rank worker outlived its LLM"
