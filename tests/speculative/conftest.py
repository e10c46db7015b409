"""Fixtures of the speculative-decoding tests: the embedded model (a real, trained HF Llama) compiled once, and
prompts whose continuation repeats them (chat transcripts in the model's own format)."""
from __future__ import annotations

import pathlib

import pytest
from spec_testlib import FORTUNES, REPO, TURN_START, transcript


@pytest.fixture(scope="session")
def embedded(tmp_path_factory) -> pathlib.Path:
    """examples/embedded.dsl compiled (fp32, cpu target) -> artifact dir."""
    import kiln

    out = tmp_path_factory.mktemp("spec_embedded") / "art"
    kiln.compile(REPO / "examples" / "embedded.dsl", out, progress=False)
    return out


@pytest.fixture(scope="session")
def doc_prompts(embedded) -> list[list[int]]:
    """Four chat transcripts in the model's own format: two of two turns that stop inside the third (the model
    goes on in the format the prompt repeats, which prompt lookup drafts), two of one turn."""
    from kiln.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded / "tokenizer")
    return [tok.encode(transcript(FORTUNES[i:i + 2]) + TURN_START if i % 2 == 0 else transcript(FORTUNES[i:i + 1]))
            for i in range(4)]
