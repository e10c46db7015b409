"""A TP=2 artifact launched by torchrun (`python -m torch.distributed.run`), not by kiln's own spawner: both
ranks run the same `kiln generate` command; rank 1 becomes the artifact's rank worker (runtime/entrypoint.py
launched_worker), rank 0 the engine, meeting at torchrun's MASTER_ADDR/MASTER_PORT (its agent's store when
torchrun hosts one). The tokens equal the single-device artifact's and every rank exits 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import free_port  # noqa: E402

PROMPT = [7, 8, 9, 10, 11]


def test_torchrun_launched_ranks_generate_the_single_device_tokens(compile_parallel):
    _, single = compile_parallel("llama", None)
    _, art = compile_parallel("llama", "tp = 2")
    with kiln.LLM(str(single), num_kv_blocks=64) as llm:
        want = llm.generate([PROMPT], kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", KILN_DIST_TIMEOUT="20")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             "-m", "kiln.cli", "generate", str(art), "--token-ids", " ".join(map(str, PROMPT)),
                             "--max-tokens", "8", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # torchrun and both ranks (its own session)
            proc.wait(10)
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = [line for line in out.decode().splitlines() if line.strip()]
    assert lines[-1].split() == [str(t) for t in want[0].outputs[0].token_ids], out.decode()
