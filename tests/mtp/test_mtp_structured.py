"""Constrained decoding with speculative decoding (the MTP draft head): the verification rows are masked by the
grammar (StructuredOutputProcessor.mask_drafts), so a draft the grammar forbids is rejected, and greedy
constrained outputs with speculation equal those without it, token for token."""
from __future__ import annotations

import re

import pytest

# The first invites repeated tokens (what the repeat head drafts).
PATTERNS = ("[ab]{6,30}", "[0-9]{2,5}(-[a-z]{1,4}){2,5}")


def _run(art, speculative):
    from kiln.runtime.grammar_spec import GrammarSpec
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    engine = LLMEngine(art, speculative=speculative, num_kv_blocks=64)
    prompts = [[5, 17, 30, 9, 44], [100, 7, 3], [250, 251, 252, 253, 254, 255, 256], [42] * 9]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, plain if i % 2 else SamplingParams(
            max_tokens=40, temperature=0.0, structured_output=GrammarSpec.regex(PATTERNS[i // 2])))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("repeat_head", [True, False], ids=["repeat_head", "random_head"])
def test_constrained_greedy_equal_with_and_without_speculation(mtp_artifact, repeat_head):
    _, art, _ = mtp_artifact(True, repeat_head=repeat_head)
    plain, _ = _run(art, None)
    spec, engine = _run(art, "mtp")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for i in (0, 2):
        assert re.fullmatch(PATTERNS[i // 2], spec[i].text), spec[i].text
        assert spec[i].finish_reason == "stop"
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["num_masked_rows"] > 0
    assert stats["num_constrained_requests"] == 0  # released when they finished


def test_verification_rows_are_masked(mtp_artifact):
    """SpeculativeDecoder.verify on logits built to tempt it: a draft the grammar forbids, though the model's
    favourite, is rejected; the target's token after an accepted draft is one the grammar allows."""
    import time
    from types import SimpleNamespace

    import torch
    from kiln.runtime.core.sequence import Sequence
    from kiln.runtime.grammar_spec import GrammarSpec
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    _, art, _ = mtp_artifact(True, repeat_head=True)
    engine = LLMEngine(art, speculative="mtp", num_kv_blocks=64)
    tok = engine.tokenizer
    [a], [b], [z] = (tok.encode(c, add_special_tokens=False) for c in "abz")
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_output=GrammarSpec.regex("[ab]{1,8}"))
    engine.add_request("r", [5, 6, 7], params)
    [seq] = engine.requests["r"].seqs
    for _ in range(1000):  # the grammar compiles off the step loop: the request waits for it, then prefills
        engine.step()
        if len(seq.token_ids) > seq.num_prompt_tokens:
            break
        time.sleep(0.01)
    first = seq.token_ids[-1]
    assert first in (a, b)
    vocab = engine.model_config.vocab_size

    def verify(drafts: list[int], favourites: list[int]) -> list[int]:
        """Row j of the logits favours favourites[j] (row 0: the target's token after the last one)."""
        probe = Sequence(seq_id=10**6, request_id="r", index=0, token_ids=list(seq.token_ids),
                         num_prompt_tokens=seq.num_prompt_tokens, params=params, max_tokens=8, arrival=0)
        probe.draft_token_ids = drafts
        logits = torch.zeros(len(favourites), vocab)
        logits[torch.arange(len(favourites)), favourites] = 10.0
        logits[:, a] = 5.0  # the grammar's best choice where the favourite is forbidden
        batch = SimpleNamespace(seqs=[probe])
        sampled = engine.sampler.sample(logits, SimpleNamespace(prompt_rows=[None], sample_rows=[0]), [probe])
        return engine.speculator.verify(batch, logits, SimpleNamespace(sample_rows=[0]), sampled)[0]

    # z is the model's favourite everywhere and the draft: forbidden, so row 0 picks a and z is rejected
    assert verify([z], [z, z]) == [a]
    # draft b accepted (row 0 favours it); the row after it favours z, which the mask turns into a
    assert verify([b], [b, z]) == [b, a]
    engine.abort_request("r")
