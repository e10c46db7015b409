"""JSON whitespace policy (issue 32 item 1): `kiln serve --json-whitespace compact` against `any` on one artifact
(the embedded model by default), json_schema (strict, five fields) at temperature 1 and max_tokens 160 through
the `openai` client: the share of N requests whose output is valid JSON that fits the schema and finished
("stop") within max_tokens, mean completion tokens, and whether a streamed answer equals the whole one with
the same seed (on the first `--stream` requests).

    python benchmarks/json_whitespace.py ARTIFACT [-n 200] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 16}, "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "city", "active", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(artifact: str, policy: str, n: int, n_stream: int, max_tokens: int) -> dict:
    import jsonschema
    import openai

    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", artifact, "--port", str(port),
                             "--json-whitespace", policy, "--served-model-name", "m", "--log-level", "warning"])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
        deadline = time.monotonic() + 300
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "kiln serve did not start"
                time.sleep(0.5)
        kw = dict(model="m", messages=MESSAGES, response_format=FORMAT, max_tokens=max_tokens, temperature=1.0)

        def one(seed: int) -> tuple[bool, str, int, str]:
            r = client.chat.completions.create(seed=seed, **kw)
            c, text = r.choices[0], r.choices[0].message.content or ""
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            return valid and c.finish_reason == "stop", c.finish_reason, r.usage.completion_tokens, text

        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
        equal = 0
        for seed in range(n_stream):
            streamed = "".join(ch.choices[0].delta.content or "" for ch in
                               client.chat.completions.create(seed=seed, stream=True, **kw) if ch.choices)
            equal += streamed == results[seed][3]
        ok = sum(r[0] for r in results)
        return {"policy": policy, "requests": n, "valid_and_finished": ok, "share": ok / n,
                "finished_length": sum(r[1] == "length" for r in results),
                "mean_completion_tokens": sum(r[2] for r in results) / n,
                "streamed_equal_whole": f"{equal}/{n_stream}", "wall_s": round(wall, 1),
                "example": results[0][3]}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--stream", type=int, default=20, help="requests also streamed and compared (default 20)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--policies", default="compact,any")
    p.add_argument("--out")
    args = p.parse_args()
    rows = [measure(args.artifact, policy, args.n, args.stream, args.max_tokens) for policy in args.policies.split(",")]
    for r in rows:
        print(f"{r['policy']:8s} {r['valid_and_finished']}/{r['requests']} valid and finished "
              f"({100 * r['share']:.1f} %), {r['finished_length']} at length, "
              f"{r['mean_completion_tokens']:.1f} tokens on average, streamed = whole {r['streamed_equal_whole']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"artifact": args.artifact, "max_tokens": args.max_tokens, "temperature": 1.0,
                       "schema": SCHEMA, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
