"""Tokenizer: incremental detokenizing of multi-byte text, chat templates rendered like transformers."""
from __future__ import annotations

import jinja2
import pytest
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["héllo wörld, ça va? naïve café", "日本語のテキストと絵文字 🙂🚀 も含む", "Привет 🙂 ok", "plain ascii text"]


@pytest.fixture(scope="module")
def tok(artifact_dir):
    return Tokenizer.from_dir(artifact_dir / "tokenizer")


def test_special_tokens_and_bos(tok):
    assert tok.bos_token == "<s>" and tok.bos_token_id == 1 and tok.eos_token_id == 2
    ids = tok.encode("hello")
    assert ids[0] == 1 and tok.encode("hello", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "hello"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids) or text.isascii()  # really splits characters
    prompt = tok.encode("The quick")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text


def test_incremental_detokenizer_holds_back_partial_character(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [1])
    assert [detok.add_tokens([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == "🙂"


def test_incremental_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("ab", add_special_tokens=False) + [tok.eos_token_id] + tok.encode("cd", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=True)
    assert "".join(detok.add_tokens([t]) for t in ids) == "abcd"


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hi there! 🙂 "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, artifact_dir, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(artifact_dir / "tokenizer"))
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected
    assert expected.startswith("<s>") and "</s>" in expected


def test_chat_template_raise_exception(tok):
    with pytest.raises(jinja2.exceptions.TemplateError, match="system message must come first"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_chat_through_llm(artifact_dir):
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(str(artifact_dir))
    out = llm.chat(MESSAGES[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    text = llm.get_tokenizer().apply_chat_template(MESSAGES[:2])
    assert out.prompt == text
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(1) == 1  # the template's bos only, not a second one from encode
