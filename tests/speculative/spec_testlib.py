"""Shared helpers of the speculative-decoding tests: prompts (random and repetitive), a run of the engine to the
end, and greedy decoding by HF transformers as the reference."""
from __future__ import annotations

import pathlib

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 512

FORTUNES = [
    "Life is a whim of several billion cells to be you for a while.",
    "The meek shall inherit the earth; the rest of us, the Universe.",
    "Experience is what causes a person to make new mistakes instead of old ones.",
    "How long a minute is depends on which side of the bathroom door you're on.",
    "I came to MIT to get an education for myself and a diploma for my mother.",
    "The Martian Canals were clearly the Martian's last ditch effort!",
    "A good friend is someone who tells you the truth, even when you do not want to hear it.",
]
TURN = "<|im_start|>user\nSay something wise.<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
TURN_START = "<|im_start|>user\nSay something"


def transcript(answers: list[str]) -> str:
    """A chat transcript in the embedded model's format, one turn per answer."""
    return "".join(TURN.format(a) for a in answers)


def prompts() -> list[list[int]]:
    """Two random prompts and two that repeat a phrase (what prompt lookup finds), of varied lengths."""
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (5, 30)]
    phrase = torch.randint(5, VOCAB, (7,), generator=g).tolist()
    return [rand[0], phrase * 4 + [11], rand[1], [3, 4] + phrase * 2]


def greedy(max_tokens: int = 24, **kw):
    from kiln.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(art, params, prompt_list=None, before=None, **engine_kw):
    """Every request through LLMEngine.step() to the end; returns ({request id: CompletionOutput}, steps,
    engine). `before(engine)` runs once the engine is built, before any request is added."""
    from kiln.runtime.llm_engine import LLMEngine

    engine = LLMEngine(art, **{"num_kv_blocks": 64, **engine_kw})
    if before is not None:
        before(engine)
    prompt_list = prompts() if prompt_list is None else prompt_list
    for i, (prompt, p) in enumerate(zip(prompt_list, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(params))], steps, engine


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def assert_all_blocks_free(engine) -> None:
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers model (eos or not), one forward per token over its KV cache."""
    out: list[int] = []
    with torch.no_grad():
        step = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def check_four_sampled_drafts(engine) -> None:
    """Rejection sampling against one-point drafts, 4 deep, through `engine`'s sampler and verifier (whatever
    its proposer): the first token of a verify step is distributed as the target's p0; given that it equals
    draft 1, the second as p1, and so on; draft j is accepted with probability p0(d1) ... p_{j-1}(d_j). 6000
    sequences with the same drafts and logits, one verify step."""
    from kiln.runtime.core.batch import LogitsLayout, ScheduledBatch
    from kiln.runtime.core.sequence import Sequence
    from kiln.runtime.sampling_params import SamplingParams

    n, drafts, k = 6000, [3, 7, 3, 9], 4
    support = [3, 7, 9]
    table = torch.tensor([[2.0, 1.0, 0.0], [0.5, 1.5, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]])
    rows = torch.full((k + 1, VOCAB), -1e9)
    rows[:, support] = table
    p = torch.softmax(rows, -1)
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    seqs = [Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1, 2], num_prompt_tokens=1, params=params,
                     max_tokens=16, arrival=i, draft_token_ids=list(drafts)) for i in range(n)]
    logits = rows.repeat(n, 1)
    layout = LogitsLayout(sample_rows=list(range(0, (k + 1) * n, k + 1)), prompt_rows=[None] * n)
    batch = ScheduledBatch(seqs=seqs, num_new_tokens=[k + 1] * n)
    sampled = engine.sampler.sample(logits, layout, seqs)
    out = engine.speculator.verify(batch, logits, layout, sampled)
    reach = 1.0
    for j in range(k + 1):
        at_j = [t[j] for t in out if len(t) > j]  # the token at position j, where the first j were accepted
        assert abs(len(at_j) / n - reach) < 0.02, (j, len(at_j) / n, reach)
        if len(at_j) > 400:
            got = torch.tensor(at_j)
            freq = torch.stack([(got == v).float().mean() for v in support])
            torch.testing.assert_close(freq, p[j, support], atol=0.04, rtol=0)
        if j < k:
            reach *= float(p[j, drafts[j]])
    accepted = sum(len(t) - 1 for t in out)
    assert engine.speculator.num_draft_tokens == k * n and engine.speculator.num_accepted_tokens == accepted


def spec_metrics(art, engine_kw: dict, prompt_list: list[list[int]], method: str) -> tuple[dict[str, float], str]:
    """Greedy completions (16 tokens) of `prompt_list` through a served core process with `engine_kw`; returns
    the kiln:spec_decode values of /metrics by name and label, and the label of `method`."""
    from fastapi.testclient import TestClient
    from kiln.runtime.api.app import build_app
    from kiln.runtime.api.async_engine import AsyncLLMEngine
    from kiln.runtime.ipc.client import CoreProcess
    from kiln.runtime.ipc.protocol import CoreConfig

    config = CoreConfig(artifact=str(art), engine={**engine_kw, "num_kv_blocks": 64}, num_threads=1)
    with CoreProcess.start(config, timeout=60) as core, \
            TestClient(build_app(AsyncLLMEngine.from_process(core), served_model_name="m")) as client:
        for prompt in prompt_list:
            r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kiln:spec_decode")}
    return values, f'{{method="{method}",model_name="m"}}'


def assert_refused_at_section(checkpoint, section: str, tmp_path, capsys, needle: str) -> None:
    """`kiln compile` of `checkpoint`'s from-hf recipe with `section` (a `speculative { }` line) added exits 2
    with `needle` at the section's line, and writes no artifact."""
    from kiln.cli import main

    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(checkpoint), "-o", str(recipe)]) == 0
    recipe.write_text(recipe.read_text().replace("  serve ", f"  {section}\n  serve ", 1))
    capsys.readouterr()
    assert main(["compile", str(recipe), "-o", str(tmp_path / "art")]) == 2
    line = next(i for i, ln in enumerate(recipe.read_text().splitlines(), 1) if "speculative" in ln)
    err = capsys.readouterr().err
    assert f"{recipe}:{line}:" in err and needle in err, err
    assert not (tmp_path / "art").exists()
