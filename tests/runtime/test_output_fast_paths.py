"""Host-overhead fast paths give the same results as the general ones: the byte-level detokenizer shortcut
(one cached piece instead of two window decodes) and `output_kind="final"` (outputs only when finished)."""
from __future__ import annotations

import random

import pytest
from kiln.runtime import RequestError, SamplingParams
from kiln.runtime.llm_engine import LLMEngine
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = ["héllo wörld, ça va? naïve café", "日本語のテキストと絵文字 🙂🚀 も含む", "Привет 🙂 ok",
          "plain ascii text, the quick brown fox", "größer ñandú — “quotes” 😀👍🏽"]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """A GPT-2 style byte-level BPE trained here on a tiny corpus: multi-byte characters mostly stay split
    across tokens, which is what the fast path must get right."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS, trainer)
    return Tokenizer(hf, {"bos_token": "<s>", "eos_token": "</s>"})


class _Counting(IncrementalDetokenizer):
    """Counts the general (two-decode) path."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.slow = 0

    def _decode_window(self) -> str:
        self.slow += 1
        return super()._decode_window()


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], fast: bool, skip: bool = True):
    tok.concatenates_pieces = fast
    try:
        detok = _Counting(tok, prompt, skip_special_tokens=skip)
        deltas = [detok.add_tokens([t]) for t in ids]
    finally:
        tok.concatenates_pieces = True
    return deltas, detok


def test_only_a_plain_byte_level_decoder_takes_the_fast_path(byte_level):
    from tokenizers import decoders

    assert byte_level.concatenates_pieces
    other = Tokenizer(byte_level._tok, {})
    byte_level._tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    try:
        assert not Tokenizer(byte_level._tok, {}).concatenates_pieces  # strips: pieces no longer concatenate
    finally:
        byte_level._tok.decoder = decoders.ByteLevel()
    assert other.concatenates_pieces


@pytest.mark.parametrize("text", CORPUS)
def test_fast_path_matches_slow_path_and_full_decode(byte_level, text):
    tok = byte_level
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids) or text.isascii()  # characters really split
    prompt = tok.encode("The quick")
    fast, detok = _stream(tok, prompt, ids, fast=True)
    slow, _ = _stream(tok, prompt, ids, fast=False)
    assert fast == slow
    assert "".join(fast) == detok.text == tok.decode(ids) == text
    assert detok.slow < len(ids)  # whole-character tokens skipped the window decodes
    if not text.isascii():
        assert detok.slow > 0  # ...and split characters went through them


def test_fast_path_matches_slow_path_on_random_tokens(byte_level):
    """Random ids make invalid UTF-8 (stray continuation bytes, truncated characters) and special tokens;
    the fast path must still agree with the general one delta for delta, with and without skipping."""
    tok = byte_level
    rng = random.Random(0)
    for skip in (True, False):
        for _ in range(30):
            prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 8))]
            ids = [rng.randrange(tok.vocab_size) for _ in range(40)]
            fast, _ = _stream(tok, prompt, ids, fast=True, skip=skip)
            slow, _ = _stream(tok, prompt, ids, fast=False, skip=skip)
            assert fast == slow


def test_final_output_kind_returns_only_finished_outputs(artifact_dir):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (3, 7)]

    def run(kind: str) -> list[list]:
        engine = LLMEngine(artifact_dir, output_kind=kind)
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", [1, 5, 9, 13], p)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
        return steps

    cumulative, final = run("cumulative"), run("final")
    assert len(cumulative) == len(final)
    assert sum(map(len, cumulative)) > 2  # the cumulative engine reported progress every step
    assert all(o.finished for step in final for o in step)
    want = [[o for o in step if o.finished] for step in cumulative]
    assert final == want and [len(s) for s in final].count(1) == 2
    assert [len(o.outputs[0].token_ids) for step in final for o in step] == [3, 7]
    with pytest.raises(RequestError, match="output_kind"):
        LLMEngine(artifact_dir, output_kind="delta")
