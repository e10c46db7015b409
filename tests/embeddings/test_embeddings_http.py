"""`POST /v1/embeddings` on a live server over the tiny embedding artifact, with the official openai client: equal to
LLM.embed and to transformers + the sentence-transformers pooling by hand; the refusals both ways."""
import base64
import struct
import sys
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from live_server import LiveServer  # noqa: E402

import kiln  # noqa: E402

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a", "JSON: {\"key\": [1, 2, 3]}"]
TOKEN_PROMPTS = [[1, 2, 3], list(range(5, 40)), [9]]
EMBED_ONLY = "this model is an embedding model (task = embed): use /v1/embeddings"


@pytest.fixture(scope="module")
def embed_model(build_embed, tmp_path_factory):
    ckpt, art = build_embed(tmp_path_factory.mktemp("embed-http"), "mean", True)
    server = LiveServer(art)
    yield ckpt, art, server
    server.stop()


@pytest.fixture(scope="module")
def generation_server(compile_hf):
    _, art, _ = compile_hf("llama")
    server = LiveServer(art)
    yield server
    server.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _name(server):
    return server.server_state.model_name


def _reference(ckpt, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' final hidden states, mean-pooled and normalized (the checkpoint's modules.json says so)."""
    model = transformers.AutoModel.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0].mean(dim=0), dim=-1)
                for p in prompts]


def _assert_close(ours, refs) -> None:
    assert len(ours) == len(refs)
    for o, ref in zip(ours, refs, strict=True):
        o, ref = torch.as_tensor(o, dtype=torch.float32), torch.as_tensor(ref, dtype=torch.float32)
        assert o.shape == ref.shape == (64,)
        assert torch.nn.functional.cosine_similarity(o, ref, dim=0).item() >= 0.99999


def _decode_base64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_texts_equal_transformers_and_llm_embed(embed_model):
    ckpt, art, server = embed_model
    client = _client(server)
    ids = [transformers.AutoTokenizer.from_pretrained(ckpt)(t)["input_ids"] for t in TEXTS]
    out = client.embeddings.create(model=_name(server), input=TEXTS, encoding_format="float", user="someone")
    assert out.object == "list" and out.model == _name(server)
    assert [d.index for d in out.data] == list(range(len(TEXTS))) and {d.object for d in out.data} == {"embedding"}
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    floats = [d.embedding for d in out.data]
    _assert_close(floats, _reference(ckpt, ids))
    with kiln.LLM(str(art)) as llm:
        _assert_close(floats, llm.embed(TEXTS))
    one = client.embeddings.create(model=_name(server), input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[1])
    _assert_close([one.data[0].embedding], [floats[1]])


def test_token_ids_float_and_base64(embed_model):
    ckpt, _, server = embed_model
    client = _client(server)
    refs = _reference(ckpt, TOKEN_PROMPTS)
    floats = client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS, encoding_format="float")
    assert floats.usage.prompt_tokens == sum(map(len, TOKEN_PROMPTS))
    _assert_close([d.embedding for d in floats.data], refs)
    b64 = client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in b64.data)  # the client hands an asked-for base64 back as is
    decoded = [_decode_base64(d.embedding) for d in b64.data]
    _assert_close(decoded, refs)
    for d, f in zip(decoded, floats.data, strict=True):  # float32 bytes of the same vector
        assert d == pytest.approx(f.embedding, abs=1e-6)
    default = client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS[1])  # the client asks for base64
    assert default.usage.prompt_tokens == len(TOKEN_PROMPTS[1])
    _assert_close([default.data[0].embedding], refs[1:2])


def test_bad_requests(embed_model):
    _, _, server = embed_model
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS, dimensions=8)
    assert e.value.body["param"] == "dimensions" and "Matryoshka" in e.value.body["message"]
    limit = server.server_state.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=_name(server), input=[[1, 2], [5] * limit], encoding_format="float")
    assert e.value.body["param"] == "input" and e.value.body["code"] == "context_length_exceeded"
    assert f"input 1 has {limit}" in e.value.body["message"]
    ok = client.embeddings.create(model=_name(server), input=[[5] * (limit - 1)], encoding_format="float")
    assert ok.usage.prompt_tokens == limit - 1
    r = httpx.post(server.url + "/v1/embeddings", json={"model": _name(server), "input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(server.url + "/v1/embeddings", json={"model": _name(server), "input": "x",
                                                         "encoding_format": "int8"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    server.wait_idle()


def test_embedding_model_refuses_generation(embed_model):
    _, _, server = embed_model
    name = _name(server)
    bodies = {"/v1/completions": {"model": name, "prompt": "hi"},
              "/v1/chat/completions": {"model": name, "messages": [{"role": "user", "content": "hi"}]},
              "/v1/responses": {"model": name, "input": "hi"}}
    for path, body in bodies.items():
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, path
        assert r.json()["error"]["message"] == EMBED_ONLY
    r = httpx.post(server.url + "/v1/messages", json={"model": name, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's error shape
    assert r.json()["error"]["message"] == EMBED_ONLY
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        _client(server).completions.create(model=name, prompt="hi", max_tokens=2)
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [name]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0


def test_generation_model_refuses_embeddings(generation_server):
    client = _client(generation_server)
    name = _name(generation_server)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=name, input="hi", encoding_format="float")
    assert "task = embed" in e.value.body["message"] and "no embeddings" in e.value.body["message"]
    assert [m.id for m in client.models.list().data] == [name]
    out = client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_matryoshka_dimensions(build_embed, tmp_path_factory):
    ckpt, art = build_embed(tmp_path_factory.mktemp("embed-mrl"), "last", True, matryoshka=[16, 32, 64])
    model = transformers.AutoModel.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        full = [model(torch.tensor([p])).last_hidden_state[0, -1] for p in TOKEN_PROMPTS]
    with kiln.LLM(str(art)) as llm:
        offline = llm.embed(TOKEN_PROMPTS, dimensions=16)
    server = LiveServer(art)
    try:
        client = _client(server)
        out = client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS, dimensions=16,
                                       encoding_format="float")
        cut = [d.embedding for d in out.data]
        assert [len(v) for v in cut] == [16] * len(TOKEN_PROMPTS)
        refs = [torch.nn.functional.normalize(v[:16], dim=-1) for v in full]  # cut, then normalized again
        for ours, ref, off in zip(cut, refs, offline, strict=True):
            ours = torch.tensor(ours)
            assert torch.nn.functional.cosine_similarity(ours, ref, dim=0).item() >= 0.99999
            assert abs(ours.norm().item() - 1.0) < 1e-5
            assert ours.tolist() == pytest.approx(off, abs=1e-6)
        b64 = client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS[:1], dimensions=32,
                                       encoding_format="base64")
        assert len(_decode_base64(b64.data[0].embedding)) == 32
        whole = client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS[:1], encoding_format="float")
        assert len(whole.data[0].embedding) == 64
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=_name(server), input=TOKEN_PROMPTS[:1], dimensions=20)
        assert e.value.body["param"] == "dimensions" and "16, 32, 64" in e.value.body["message"]
    finally:
        server.stop()
