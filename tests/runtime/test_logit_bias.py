"""logit_bias in the sampler: added before constraint masks and sampling, on the synchronous, async-scheduling
and speculative-verification paths, to its own request's rows only; and its validation."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime.core.batch import LogitsLayout
from kiln.runtime.core.sampler import Sampler
from kiln.runtime.core.sequence import Sequence
from kiln.runtime.errors import RequestError
from kiln.runtime.ipc.protocol import RequestLimits, decode_params, encode_params
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.validation import check_request

VOCAB = 50


def seq(i: int, **kw) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1, 2], num_prompt_tokens=2,
                    params=SamplingParams(**kw), max_tokens=4, arrival=i)


def layout(n: int) -> LogitsLayout:
    return LogitsLayout(sample_rows=list(range(n)), prompt_rows=[None] * n)


def test_bias_moves_the_greedy_token_and_logprobs_see_it():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(dim=-1).tolist()
    seqs = [seq(0, temperature=0, logit_bias={7: 100.0}, logprobs=0), seq(1, temperature=0, logprobs=0),
            seq(2, temperature=0, logit_bias={top[2]: -100.0})]
    out = Sampler().sample(logits.clone(), layout(3), seqs)
    assert out.sampled[0] == 7 and out.sampled[1] == top[1]
    biased = logits[2].clone()
    biased[top[2]] -= 100
    assert out.sampled[2] == int(biased.argmax()) != top[2]
    expected = torch.log_softmax(logits[0] + 100 * torch.nn.functional.one_hot(torch.tensor(7), VOCAB), -1)[7]
    assert out.logprobs[0][1][0] == pytest.approx(float(expected), abs=1e-5)
    assert out.logprobs[1][1][0] == pytest.approx(float(torch.log_softmax(logits[1], -1)[top[1]]), abs=1e-5)


def test_bias_comes_before_the_constraint_mask():
    """The logits processor (grammars) sees the biased logits, and a token it rules out stays out however much
    it is favoured."""
    seen = []

    def allow_only_3_and_4(rows: torch.Tensor, seqs: list[Sequence]) -> None:
        seen.append(rows.clone())
        mask = torch.full_like(rows, float("-inf"))
        mask[:, 3:5] = 0
        rows += mask

    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    out = Sampler(logits_processor=allow_only_3_and_4).sample(
        logits, layout(1), [seq(0, temperature=0, logit_bias={9: 100.0, 3: 2.0})])
    assert seen[0][0, 9] == 100.0 and seen[0][0, 3] == 2.0  # applied before the mask
    assert out.sampled == [3]  # 9 is ruled out; 3's bias beats 4's logit


def test_bias_on_the_async_and_speculative_paths():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    seqs = [seq(0, temperature=0, logit_bias={11: 100.0}), seq(1, temperature=0)]
    tokens, marked = Sampler().sample_on_device(logits.clone(), layout(2), seqs)
    assert tokens.tolist() == marked.tolist() == [11, int(logits[1].argmax())]
    original = logits.clone()
    assert Sampler().sample_tokens(logits, seqs) == [11, int(logits[1].argmax())]
    assert torch.equal(logits, original)  # the verification rows are not changed for the caller
    sampled = Sampler(seed=3).sample(logits.clone(), layout(2), [seq(0, temperature=1.0, logit_bias={5: 100.0}),
                                                                   seq(1, temperature=1.0, logit_bias={6: 100.0})])
    assert sampled.sampled == [5, 6]


@pytest.mark.parametrize(("bias", "message"), [
    ({3: 100.5}, "logit_bias values"), ({3: float("nan")}, "logit_bias values"), ({-1: 1.0}, "logit_bias keys"),
    ({"3": 1.0}, "logit_bias keys"), ([3], "logit_bias must map"), ({3: True}, "logit_bias values"),
    ({i: 1.0 for i in range(1025)}, "at most 1024"),
])
def test_bad_bias_is_refused(bias, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(logit_bias=bias)


def test_bias_past_the_vocabulary_and_the_wire():
    limits = RequestLimits(vocab_size=VOCAB, max_model_len=64, block_size=4, num_blocks=64)
    with pytest.raises(RequestError, match=r"logit_bias token ids must be in \[0, 50\)"):
        check_request([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}), limits)
    params = SamplingParams(logit_bias={3: -100, 49: 0.5})
    check_request([1, 2], params, limits)
    assert decode_params(encode_params(params)).logit_bias == {3: -100.0, 49: 0.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
