"""`POST /v1/rerank` and `POST /v1/score` on a live server over a tiny random Qwen3 whose tokenizer spells "yes" and
"no" as one token each: the relevance equals transformers' softmax over the [yes, no] logits at the last position
of Qwen3-Reranker's prompt (1e-5); ordering, top_n, one-to-many and pairwise scores; the refusals."""
import sys
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import LiveServer  # noqa: E402

# Qwen3-Reranker's model card, written out here (not read from kiln's module)
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.", "a",
        "JSON: {\"key\": [1, 2, 3]}", "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def reranker(compile_hf):
    ckpt, art, _ = compile_hf("qwen3", extra_tokens=("yes", "no"))
    server = LiveServer(art)
    yield ckpt, server
    server.stop()


def _reference(ckpt, pairs, instruction=DEFAULT_INSTRUCTION) -> list[float]:
    """The model card's computation: prefix + pair + suffix token ids, last-position logits, softmax over [yes, no]."""
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix, suffix = tok.encode(PREFIX, add_special_tokens=False), tok.encode(SUFFIX, add_special_tokens=False)
    out = []
    with torch.no_grad():
        for q, d in pairs:
            body = tok.encode(f"<Instruct>: {instruction}\n<Query>: {q}\n<Document>: {d}", add_special_tokens=False)
            logits = model(torch.tensor([prefix + body + suffix])).logits[0, -1]
            out.append(torch.softmax(logits[[yes, no]].double(), dim=0)[0].item())
    return out


def _name(server):
    return server.server_state.model_name


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def test_rerank_equals_transformers(reranker):
    ckpt, server = reranker
    refs = _reference(ckpt, [(QUERY, d) for d in DOCS])
    assert max(refs) - min(refs) > 1e-4  # the documents score apart, so the order below means something
    r = _post(server, "/v1/rerank", {"model": _name(server), "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == _name(server) and body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    for x in results:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert abs(x["relevance_score"] - refs[x["index"]]) < 1e-5
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -refs[i])
    assert body["usage"]["total_tokens"] > 0
    top = _post(server, "/v1/rerank", {"model": _name(server), "query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [x["index"] for x in top["results"]] == [x["index"] for x in results[:2]]
    assert top["usage"] == body["usage"]  # every document is scored, two returned


def test_rerank_instruction(reranker):
    ckpt, server = reranker
    instruction = "Find the document that mentions an animal"
    refs = _reference(ckpt, [(QUERY, d) for d in DOCS[:2]], instruction)
    assert refs != pytest.approx(_reference(ckpt, [(QUERY, d) for d in DOCS[:2]]), abs=1e-6)
    r = _post(server, "/v1/rerank", {"model": _name(server), "query": QUERY, "documents": DOCS[:2],
                                     "instruction": instruction})
    for x in r.json()["results"]:
        assert abs(x["relevance_score"] - refs[x["index"]]) < 1e-5


def test_score_one_to_many_and_pairwise(reranker):
    ckpt, server = reranker
    refs = _reference(ckpt, [(QUERY, d) for d in DOCS[:3]])
    r = _post(server, "/v1/score", {"model": _name(server), "text_1": QUERY, "text_2": DOCS[:3]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == _name(server)
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    assert [d["score"] for d in body["data"]] == pytest.approx(refs, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    queries = ["Where is Paris?", "Which animal is quick?"]
    pairs = list(zip(queries, DOCS[:2], strict=True))
    body = _post(server, "/v1/score", {"model": _name(server), "text_1": queries, "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(_reference(ckpt, pairs), abs=1e-5)
    one = _post(server, "/v1/score", {"model": _name(server), "text_1": QUERY, "text_2": DOCS[0]}).json()
    assert len(one["data"]) == 1 and one["data"][0]["score"] == pytest.approx(refs[0], abs=1e-5)


def test_bad_requests(reranker):
    _, server = reranker
    name = _name(server)
    cases = [("/v1/score", {"model": name, "text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_2"),
             ("/v1/score", {"model": name, "text_1": [], "text_2": "x"}, "text_1"),
             ("/v1/rerank", {"model": name, "query": "q", "documents": []}, "documents"),
             ("/v1/rerank", {"model": name, "query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
             ("/v1/rerank", {"model": name, "query": "q", "documents": ["x" + " x" * server.server_state.max_model_len]},
              "documents")]
    for path, body, param in cases:
        r = _post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param
    r = _post(server, "/v1/rerank", {"model": "other", "query": "q", "documents": ["d"]})
    assert r.status_code == 404
    server.wait_idle()


def test_model_without_yes_no_tokens_refused(compile_hf):
    ckpt, art, _ = compile_hf("llama")
    assert len(transformers.AutoTokenizer.from_pretrained(ckpt).encode("yes", add_special_tokens=False)) > 1
    server = LiveServer(art)
    try:
        for path, body in (("/v1/rerank", {"query": "q", "documents": ["d"]}),
                           ("/v1/score", {"text_1": "q", "text_2": "d"})):
            r = _post(server, path, {"model": _name(server), **body})
            assert r.status_code == 400 and r.json()["error"]["code"] == "not_a_reranker"
            assert "'yes'" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_embedding_model_refuses_rerank(build_embed, tmp_path_factory):
    _, art = build_embed(tmp_path_factory.mktemp("embed-rerank"), "last", True)
    server = LiveServer(art)
    try:
        r = _post(server, "/v1/rerank", {"model": _name(server), "query": "q", "documents": ["d"]})
        assert r.status_code == 400 and "use /v1/embeddings" in r.json()["error"]["message"]
        r = _post(server, "/v1/score", {"model": _name(server), "text_1": "q", "text_2": "d"})
        assert r.status_code == 400 and "use /v1/embeddings" in r.json()["error"]["message"]
    finally:
        server.stop()
