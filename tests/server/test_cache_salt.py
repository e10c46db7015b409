"""cache_salt (vLLM's field): requests with different salts never share prefix-cache blocks; a server started
with require_cache_salt (`kiln serve --require-cache-salt`) refuses requests without one."""
from __future__ import annotations

import httpx
from live_server import MODEL

PROMPT = "Paged attention stores keys and values in fixed size blocks, and a prefix cache shares them. " * 3


def _hits(server) -> int:
    return server.in_engine(lambda e: e.block_manager.prefix_cache.hits)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


def test_requests_with_other_salts_share_no_prefix_block(make_server):
    server = make_server({"num_kv_blocks": 256})
    bodies = {"/v1/completions": {"prompt": "1 " + PROMPT, "max_tokens": 2},  # a prompt of its own each
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "2 " + PROMPT}], "max_tokens": 2},
              "/v1/responses": {"input": "3 " + PROMPT, "max_output_tokens": 2}}
    for path, body in bodies.items():
        salt = path.rsplit("/", 1)[1]
        assert _post(server, path, body).status_code == 200  # unsalted first (the chat template's head may hit)
        before = _hits(server)
        assert _post(server, path, {**body, "cache_salt": salt + "-a"}).status_code == 200
        assert _hits(server) == before, f"{path}: a salted request hit an unsalted one's blocks"
        assert _post(server, path, {**body, "cache_salt": salt + "-b"}).status_code == 200
        assert _hits(server) == before, f"{path}: another salt hit the first salted request's blocks"
        assert _post(server, path, {**body, "cache_salt": salt + "-a"}).status_code == 200
        assert _hits(server) > before, f"{path}: the same salt did not hit"
    bad = _post(server, "/v1/completions", {"prompt": PROMPT, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    server.wait_idle()


def test_a_server_requiring_a_salt_refuses_requests_without_one(make_server):
    server = make_server({"num_kv_blocks": 64}, require_cache_salt=True)
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        refused = _post(server, path, body)
        assert refused.status_code == 400, path
        assert refused.json()["error"]["param"] == "cache_salt" and "cache_salt" in refused.json()["error"]["message"]
        assert _post(server, path, {**body, "cache_salt": "tenant-1"}).status_code == 200, path
