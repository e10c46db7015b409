"""An in-process prefill/decode pair over one transport, driven step by step (the router's protocol without
processes): the decode core reserves, the prefill core prefills and pushes, the decode core commits and
decodes. Used to check identity with co-located serving and every transport fault deterministically."""
from __future__ import annotations

import itertools

from kiln.runtime.core.engine import EngineCore
from kiln.runtime.disagg.roles import DecodeRole, PrefillRole
from kiln.runtime.disagg.transport import InProcTransport, Transport
from kiln.runtime.sampling_params import SamplingParams


def run_colocated(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, tuple]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    return collect(engine, lambda: None)


def collect(engine: EngineCore, between, max_steps: int = 10_000) -> dict[str, tuple]:
    """Steps `engine` (calling `between()` before each step) until it is idle; (token ids, logprobs) per request."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    finish: dict[str, str | None] = {}
    for _ in range(max_steps):
        between()
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.logprobs:
                logprobs.setdefault(d.request_id, []).extend(lp[1][0] for lp in d.logprobs)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason
    else:
        raise AssertionError("the engine did not finish")
    return {r: (tokens[r], logprobs.get(r, []), finish.get(r)) for r in tokens}


class Pair:
    def __init__(self, prefill: EngineCore, decode: EngineCore, transport: Transport | None = None,
                 receiver: Transport | None = None, threaded: bool = False, **decode_kw) -> None:
        transport = transport or InProcTransport()
        self.transport = transport
        self.prefill, self.decode = prefill, decode
        self.decode_role = DecodeRole(decode, receiver or transport, **decode_kw)
        # threaded: sends from a thread while this one polls (a transport with flow control needs that)
        self.prefill_role = PrefillRole(prefill, lambda endpoint: transport, threaded=threaded)
        self._ids = itertools.count()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, **policy):
        tid = f"x{next(self._ids)}"
        desc = self.decode_role.add_request(request_id, prompt, params, tid, **policy)
        if desc is not None:
            self.prefill_role.add(tid, prompt, desc)
        return desc

    def pump(self) -> None:
        """One prefill step (its transfers go out as it finishes them), then the decode side's frames."""
        if self.prefill.has_unfinished_requests():
            self.prefill.step()
        self.decode_role.poll()

    def run(self, prompts: list[list[int]], params: SamplingParams) -> dict[str, tuple]:
        for i, p in enumerate(prompts):
            self.add(f"r{i}", p, params)
        return collect(self.decode, self.pump)
