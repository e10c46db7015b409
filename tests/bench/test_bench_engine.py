"""`kiln bench engine`: the phase breakdown of a steady-decode step with the instant executor."""
from __future__ import annotations

import json

import torch
from standin_artifact import write_artifact

from kiln.bench import PHASES, InstantModel, _timed_step
from kiln.cli import main


def test_engine_overhead_report(tmp_path, capsys):
    art = write_artifact(tmp_path / "standin")
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "engine", str(art), "--batch-sizes", "1,8", "--steps", "20", "--torch-threads", "1",
                     "--json", str(tmp_path / "e.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert all(p in printed for p in (*PHASES, "steps/s"))
    report = json.loads((tmp_path / "e.json").read_text())
    assert set(report["batch_sizes"]) == {"1", "8"} and report["torch_threads"] == 1
    for size in report["batch_sizes"].values():
        assert set(size["phases_us"]) == set(PHASES)
        assert all(s["count"] == 20 and s["mean"] >= 0 for s in size["phases_us"].values())
        assert size["step_us"]["count"] == 20 and size["steps_per_s"] > 0


def test_timed_step_is_engine_step(tmp_path):
    """The instrumented step makes the same calls as `LLMEngine.step()`: same tokens either way."""
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    art = write_artifact(tmp_path / "standin")
    tokens = []
    for timed in (False, True):
        engine = LLMEngine(art, num_kv_blocks=64)
        engine.runner.model = InstantModel(engine.model_config.vocab_size, max_rows=8, seed=1)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i] * (6 + i), SamplingParams(max_tokens=12, temperature=0.0,
                                                                            ignore_eos=True))
        for _ in range(12):
            _timed_step(engine, lambda: 0.0) if timed else engine.step()
        tokens.append([s.token_ids for s in engine.scheduler.running])
    assert tokens[0] == tokens[1] and all(len(t) > 6 for t in tokens[0])
