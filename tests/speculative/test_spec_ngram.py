"""N-gram (prompt lookup) speculative decoding on the embedded model (a trained Llama, compiled from its HF
checkpoint) over prompts that quote themselves: greedy outputs equal plain greedy decoding and HF transformers'
for k = 1, 2, 4 (drafts accepted and rejected, every KV block free afterwards); penalties, logprobs and stop strings give what they give without speculation; sampled
verification of 4 drafts keeps the target distribution; the recipe and the CLI turn it on; /metrics reports its
acceptance under its method's label."""
from __future__ import annotations

import pytest
import torch
from spec_testlib import (
    REPO,
    assert_all_blocks_free,
    check_four_sampled_drafts,
    greedy,
    hf_greedy,
    run,
    spec_metrics,
    tokens,
)

LLAMA_SPEC = ("  serve ", "  speculative { method = ngram; tokens = 4 }\n  serve ")


@pytest.fixture(scope="module")
def llama(compile_hf):
    ckpt, art, _ = compile_hf("llama")
    return ckpt, art


@pytest.fixture(scope="module")
def plain(embedded, doc_prompts):
    """The non-speculative greedy tokens of doc_prompts (max_tokens 24, 7, 24, 13), and the steps they took."""
    outs, steps, _ = run(embedded, [greedy(m) for m in (24, 7, 24, 13)], doc_prompts, speculative=None)
    return tokens(outs), steps


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_plain_decoding(embedded, doc_prompts, plain, k):
    params = [greedy(m) for m in (24, 7, 24, 13)]
    outs, steps, engine = run(embedded, params, doc_prompts, speculative="ngram", num_speculative_tokens=k)
    assert tokens(outs) == plain[0]
    s = engine.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]  # repeats found, and misses
    assert s["spec_num_draft_tokens"] <= k * s["spec_num_drafts"]
    assert s["spec_mean_acceptance_length"] == pytest.approx(1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"])
    assert steps < plain[1]  # accepted drafts are tokens without a step of their own
    assert engine.speculator.proposer.__class__.__name__ == "NgramProposer"
    assert_all_blocks_free(engine)


def test_greedy_equals_hf_transformers(embedded, doc_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(REPO / "examples" / "embedded", dtype=torch.float32).eval()
    outs, _, engine = run(embedded, [greedy(20)] * 4, doc_prompts, speculative="ngram", num_speculative_tokens=4)
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    for prompt, got in zip(doc_prompts, tokens(outs), strict=True):
        assert got == hf_greedy(model, prompt, 20)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_under_a_small_pool(embedded, doc_prompts, plain, preemption):
    """12 blocks of 16 tokens for 4 sequences needing up to 6 each: preempted sequences drop their drafts and
    resume with the same greedy tokens."""
    params = [greedy(m) for m in (24, 7, 24, 13)]
    outs, _, engine = run(embedded, params, doc_prompts, speculative="ngram", num_speculative_tokens=4,
                          num_kv_blocks=12,
                          preemption=preemption, swap_space_bytes=2**22)
    assert engine.stats()["num_preemptions"] > 0
    assert tokens(outs) == plain[0]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.2}, {"presence_penalty": 0.4}, {"frequency_penalty": 0.3},
    {"repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.2}], ids=["rep", "pres", "freq", "all"])
def test_penalties_with_speculation_equal_plain(embedded, doc_prompts, penalties):
    """Penalties count the drafts before each verified position: greedy with penalties is unchanged by
    speculation (and drafts are verified, not turned off, for these requests)."""
    params = [greedy(24, **penalties) for _ in range(4)]
    want, _, _ = run(embedded, params, doc_prompts, speculative=None)
    got, _, engine = run(embedded, params, doc_prompts, speculative="ngram", num_speculative_tokens=4)
    assert tokens(got) == tokens(want)
    assert engine.stats()["spec_num_accepted_tokens"] > 0


def _logprob_table(out) -> list[list[tuple[int, float, int]]]:
    return [[(t, lp.logprob, lp.rank) for t, lp in position.items()] for position in out.logprobs]


def test_logprobs_with_speculation_equal_plain(embedded, doc_prompts):
    """One logprobs entry per token, the chosen token's and the top 3, equal to those without speculation."""
    params = [greedy(20, logprobs=3) for _ in range(4)]
    want, _, _ = run(embedded, params, doc_prompts, speculative=None)
    got, _, engine = run(embedded, params, doc_prompts, speculative="ngram", num_speculative_tokens=4)
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids) == 20
        gt, wt = _logprob_table(g), _logprob_table(w)
        assert [[(t, r) for t, _, r in p] for p in gt] == [[(t, r) for t, _, r in p] for p in wt]
        torch.testing.assert_close(torch.tensor([[lp for _, lp, _ in p] for p in gt]),
                                   torch.tensor([[lp for _, lp, _ in p] for p in wt]), atol=1e-4, rtol=0)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


def test_stop_strings_and_tokens_with_speculation_equal_plain(embedded, doc_prompts):
    """Stop strings (the front-end's, on text) and stop tokens (the core's) end a completion where they do
    without speculation, also when the stop falls inside a step's accepted drafts."""
    import kiln

    art = str(embedded)
    plain_llm = kiln.LLM(art, speculative=None, num_kv_blocks=64)
    spec_llm = kiln.LLM(art, speculative="ngram", num_speculative_tokens=4, num_kv_blocks=64)
    free = plain_llm.generate(doc_prompts, greedy(24))
    params = []
    for out in free:  # a stop string from the middle of each completion's text, and a stop token of its own
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        stop = text[len(text) // 2:len(text) // 2 + 3] if len(text) >= 6 else None
        params.append(greedy(24, stop=[stop] if stop and stop.strip() else None, stop_token_ids=[ids[17]]))
    want = plain_llm.generate(doc_prompts, params)
    got = spec_llm.generate(doc_prompts, params)
    assert spec_llm.engine.stats()["spec_num_accepted_tokens"] > 0
    for g, w in zip(got, want, strict=True):
        go, wo = g.outputs[0], w.outputs[0]
        assert (go.text, go.token_ids, go.finish_reason, go.stop_reason) == \
            (wo.text, wo.token_ids, wo.finish_reason, wo.stop_reason)
    assert any(w.outputs[0].finish_reason == "stop" for w in want)
    assert any(len(w.outputs[0].token_ids) < 24 for w in want)


def test_verifying_four_sampled_drafts_keeps_the_target_distribution(llama):
    from kiln.runtime.llm_engine import LLMEngine

    check_four_sampled_drafts(LLMEngine(llama[1], speculative="ngram", num_speculative_tokens=4, num_kv_blocks=8,
                                        seed=11))


def test_seeded_sampled_requests_are_reproducible(embedded, doc_prompts):
    from kiln.runtime.sampling_params import SamplingParams

    params = [greedy(20), SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
              greedy(20), SamplingParams(max_tokens=20, temperature=1.0, top_k=4, seed=6, ignore_eos=True)]
    plain_outs, _, _ = run(embedded, params, doc_prompts, speculative=None)
    a, _, engine = run(embedded, params, doc_prompts, speculative="ngram", num_speculative_tokens=4)
    b, _, _ = run(embedded, params, doc_prompts, speculative="ngram", num_speculative_tokens=4)
    assert [tokens(a)[0], tokens(a)[2]] == [tokens(plain_outs)[0], tokens(plain_outs)[2]]
    assert tokens(a) == tokens(b) and [len(t) for t in tokens(a)] == [20] * 4
    assert_all_blocks_free(engine)


def test_recipe_section_and_cli_turn_it_on(compile_hf):
    import json

    from kiln.runtime.entrypoint import add_serve_args
    from kiln.runtime.llm_engine import LLMEngine

    _, art, _ = compile_hf("llama", edits=(LLAMA_SPEC,))
    assert json.loads((art / "manifest.json").read_text())["speculative"] == {"method": "ngram", "num_tokens": 4}
    engine = LLMEngine(art, num_kv_blocks=8)
    assert (engine.speculative.method, engine.speculative.num_tokens) == ("ngram", 4)
    assert LLMEngine(art, num_kv_blocks=8, speculative=None).speculative is None  # `kiln serve --speculative none`
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "3"])
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 3)


def test_bad_token_counts_are_refused(llama):
    from kiln.runtime.errors import ArtifactError
    from kiln.runtime.llm_engine import LLMEngine

    with pytest.raises(ArtifactError, match="at least 1"):
        LLMEngine(llama[1], speculative="ngram", num_speculative_tokens=0, num_kv_blocks=8)
    with pytest.raises(ArtifactError, match="needs a draft head"):
        LLMEngine(llama[1], speculative="eagle", num_kv_blocks=8)


def test_acceptance_in_metrics_endpoint_labelled_by_method(embedded, doc_prompts):
    values, label = spec_metrics(embedded, {"speculative": "ngram", "num_speculative_tokens": 4}, doc_prompts,
                                 "ngram")
    drafts = values["kiln:spec_decode_num_drafts_total" + label]
    drafted = values["kiln:spec_decode_num_draft_tokens_total" + label]
    accepted = values["kiln:spec_decode_num_accepted_tokens_total" + label]
    assert 0 < drafts <= drafted <= 4 * drafts and 0 < accepted < drafted
    assert values["kiln:spec_decode_draft_acceptance_rate" + label] == pytest.approx(accepted / drafted)
    assert values["kiln:spec_decode_mean_acceptance_length" + label] == pytest.approx(1 + accepted / drafts)
