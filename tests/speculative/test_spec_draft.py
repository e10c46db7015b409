"""Draft-model speculative decoding: a second compiled artifact (a smaller random Llama sharing the tokenizer,
or the target itself) drafts k tokens with its own KV pool; greedy outputs equal plain greedy decoding for k =
1, 2, 4 whether its drafts are mostly right (the target as its own draft) or mostly wrong (another model);
penalties and logprobs with it equal those without; a draft of another vocabulary is refused."""
from __future__ import annotations

import pytest
import torch
from spec_testlib import assert_all_blocks_free, assert_refused_at_section, greedy, run, tokens


@pytest.fixture(scope="module")
def target(compile_hf):
    return compile_hf("llama")[1]


@pytest.fixture(scope="module")
def small_draft(compile_hf):
    """Another random Llama, 1 layer, same tokenizer and vocabulary."""
    return compile_hf("llama", seed=7, num_hidden_layers=1)[1]


@pytest.fixture(scope="module")
def plain(target):
    outs, _, _ = run(target, [greedy(m) for m in (24, 7, 24, 13)], speculative=None)
    return tokens(outs)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("which", ["self", "small"])
def test_greedy_equals_plain_decoding(target, small_draft, plain, k, which):
    from kiln.runtime.core.batch import ScheduledBatch

    draft = target if which == "self" else small_draft
    outs, _, engine = run(target, [greedy(m) for m in (24, 7, 24, 13)], speculative="draft",
                          num_speculative_tokens=k, speculative_model=str(draft))
    assert tokens(outs) == plain
    s = engine.stats()
    assert s["spec_num_draft_tokens"] > 0
    if which == "self":  # its own greedy tokens: accepted but where fp32 rounding of another batch shape differs
        assert s["spec_acceptance_rate"] > 0.9
    else:
        assert s["spec_acceptance_rate"] < 0.5
    assert_all_blocks_free(engine)
    proposer = engine.speculator.proposer
    proposer.propose(ScheduledBatch(), None, [], [])  # a later step drops the finished sequences' shadows
    assert len(proposer.shadows) == 0
    proposer.block_manager.check_invariants([])


def test_preemption_under_a_small_pool(target, small_draft, plain):
    outs, _, engine = run(target, [greedy(m) for m in (24, 7, 24, 13)], speculative="draft",
                          num_speculative_tokens=3, speculative_model=str(target), num_kv_blocks=6)
    assert engine.stats()["num_preemptions"] > 0
    assert tokens(outs) == plain
    assert_all_blocks_free(engine)


def test_penalties_and_logprobs_equal_plain(target):
    """The target as its own draft proposes its unpenalised greedy tokens: penalties reject some of them and
    accept others, and the outputs and logprobs are those of decoding without speculation."""
    params = [greedy(20, repetition_penalty=1.2, frequency_penalty=0.2, logprobs=2) for _ in range(4)]
    want, _, _ = run(target, params, speculative=None)
    got, _, engine = run(target, params, speculative="draft", num_speculative_tokens=4,
                         speculative_model=str(target))
    s = engine.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want, strict=True):
        assert [list(p) for p in g.logprobs] == [list(p) for p in w.logprobs]  # the same tokens at each position
        torch.testing.assert_close(torch.tensor([lp.logprob for p in g.logprobs for lp in p.values()]),
                                   torch.tensor([lp.logprob for p in w.logprobs for lp in p.values()]),
                                   atol=1e-4, rtol=0)


def test_draft_of_another_vocabulary_is_refused(target, compile_hf):
    from kiln.runtime.errors import ArtifactError
    from kiln.runtime.llm_engine import LLMEngine

    other = compile_hf("llama", seed=3, num_hidden_layers=1, vocab_size=640)[1]
    with pytest.raises(ArtifactError, match="must share the target's tokenizer"):
        LLMEngine(target, speculative="draft", speculative_model=str(other), num_kv_blocks=8)
    with pytest.raises(ArtifactError, match="no draft model"):
        LLMEngine(target, speculative="draft", num_kv_blocks=8)


def test_recipe_compiles_the_draft_into_the_artifact(compile_hf, tiny_checkpoint, plain):
    """`speculative { method = draft; draft = "hf:DIR" }` compiles the draft checkpoint into the artifact's
    draft/ (its own manifest and weights); serving the artifact turns draft-model speculation on."""
    import json

    small = tiny_checkpoint("llama", seed=7, num_hidden_layers=1)
    section = ("  serve ", f'  speculative {{ method = draft; tokens = 3; draft = "hf:{small}" }}\n  serve ')
    _, art, _ = compile_hf("llama", edits=(section,))
    spec = json.loads((art / "manifest.json").read_text())["speculative"]
    assert spec == {"method": "draft", "num_tokens": 3, "draft_model": "draft"}
    assert json.loads((art / "draft" / "manifest.json").read_text())["kv_cache"]["num_layers"] == 1
    outs, _, engine = run(art, [greedy(m) for m in (24, 7, 24, 13)])
    assert (engine.speculative.method, engine.speculative.num_tokens) == ("draft", 3)
    assert tokens(outs) == plain and engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("section, needle", [
    ("speculative { method = draft; tokens = 2 }", 'method = draft; draft = "hf:DIR"'),
    ('speculative { method = draft; draft = "hf:./no-such-dir" }', "draft checkpoint directory"),
])
def test_bad_draft_sections_are_refused_at_their_place(compile_hf, tiny_checkpoint, tmp_path, capsys, section, needle):
    assert_refused_at_section(tiny_checkpoint("llama"), section, tmp_path, capsys, needle)
