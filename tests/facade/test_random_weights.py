"""Artifacts compiled with `weights = random(seed=0)` load and serve: token ids without a tokenizer, text with
`tokenizer = "hf:DIR"` (issue 10, item 7)."""
from __future__ import annotations

import textwrap

import pytest

import kiln
from kiln.cli import main

MODEL = "llama(vocab=96, hidden=32, layers=2, heads=2, ffn=64, max_position=128)"


def _compile(tmp_path, extra: str = "", name: str = "art"):
    recipe = tmp_path / f"{name}.dsl"
    recipe.write_text(textwrap.dedent(f"""\
        recipe r {{
          model   = {MODEL}
          weights = random(seed=0)
          {extra}
          serve   {{ served_name = "rand" }}
        }}
        """))
    res = kiln.compile(recipe, tmp_path / name, progress=False)
    return tmp_path / name, res.manifest


@pytest.fixture(scope="module")
def random_artifact(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("random"))[0]


def test_random_artifact_generates_token_ids(random_artifact):
    llm = kiln.LLM(str(random_artifact))
    assert llm.get_tokenizer() is None
    params = kiln.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3]], params)
    ids = out.outputs[0].token_ids
    assert len(ids) == 5 and all(0 <= t < 96 for t in ids)
    assert llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == ids  # greedy: deterministic


def test_kiln_generate_token_ids(random_artifact, capsys):
    assert main(["generate", str(random_artifact), "1, 2 3", "--token-ids", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    printed = capsys.readouterr().out.split()
    greedy = kiln.LLM(str(random_artifact)).generate(
        [[1, 2, 3]], kiln.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    assert [int(t) for t in printed] == greedy


def test_kiln_generate_text_without_a_tokenizer_is_a_clear_error(random_artifact, capsys):
    assert main(["generate", str(random_artifact), "Once upon a time"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "--token-ids" in err and "Traceback" not in err
    assert main(["generate", str(random_artifact), "1 x 3", "--token-ids"]) == 2
    assert "token ids separated by spaces or commas" in capsys.readouterr().err


def test_served_random_artifact_returns_token_ids(random_artifact):
    from fastapi.testclient import TestClient
    from kiln.runtime.api.app import build_app
    from kiln.runtime.api.async_engine import AsyncLLMEngine
    from kiln.runtime.ipc.client import CoreProcess
    from kiln.runtime.ipc.protocol import CoreConfig

    with CoreProcess.start(CoreConfig(artifact=str(random_artifact), num_threads=1), timeout=60) as core, \
            TestClient(build_app(AsyncLLMEngine.from_process(core))) as client:
        assert client.get("/health").status_code == 200
        body = {"model": "rand", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == 4 and choice["text"] == ""
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        import json

        streamed = [t for c in chunks for t in json.loads(c[6:])["choices"][0].get("token_ids", [])]
        assert streamed == choice["token_ids"]
        r = client.post("/v1/completions", json={**body, "prompt": "some text"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_random_weights_with_a_tokenizer_serve_text(tmp_path):
    """`tokenizer = "hf:DIR"` gives a random-weight artifact a tokenizer: text in, text out."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    art, manifest = _compile(tmp_path, 'tokenizer = "hf:./tok"')
    assert manifest["tokenizer"] == {"dir": "tokenizer"} and (art / "tokenizer" / "tokenizer.json").is_file()
    llm = kiln.LLM(str(art))
    (out,) = llm.generate(["w1 w2 w3"], kiln.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out.prompt_token_ids == [1, 2, 3]
    assert out.outputs[0].text.split() == [f"w{t}" for t in out.outputs[0].token_ids]


def test_tokenizer_setting_must_name_a_directory(tmp_path, capsys):
    recipe = tmp_path / "r.dsl"
    recipe.write_text(f'recipe r {{\n  model = {MODEL}\n  weights = random(seed=0)\n  tokenizer = "hf:./nope"\n}}\n')
    assert main(["compile", str(recipe), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{recipe}:4:") and "tokenizer directory" in err and "does not exist" in err
