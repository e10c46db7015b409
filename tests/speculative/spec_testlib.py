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


def run(art, params, prompt_list=None, **engine_kw):
    """Every request through LLMEngine.step() to the end; returns ({request id: CompletionOutput}, steps,
    engine)."""
    from kiln.runtime.engine import LLMEngine

    engine = LLMEngine(art, **{"num_kv_blocks": 64, **engine_kw})
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
