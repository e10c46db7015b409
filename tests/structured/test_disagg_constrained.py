"""A constrained request on a disaggregated decode core: its sequence waits outside the scheduler while its
grammar compiles (PENDING), so the decode role prefills it locally (decision `local:grammar_compiling`) instead
of leasing blocks for a remote prefill, and it decodes under its grammar; an unconstrained neighbour still goes
remote. (Before: the role took the PENDING sequence out of the waiting queue it was not in: ValueError.)"""
from __future__ import annotations

import json

import pytest
from kiln.runtime.disagg.roles import DecodeRole, PrefillRole
from kiln.runtime.disagg.transport import InProcTransport
from kiln.runtime.grammar_spec import GrammarSpec
from kiln.runtime.sampling_params import SamplingParams
from schemas import PERSON

jsonschema = pytest.importorskip("jsonschema")


def test_constrained_request_prefills_on_the_decode_core(embedded_artifact):
    import torch
    from kiln.runtime.core.engine import EngineCore

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode = EngineCore(embedded_artifact, num_kv_blocks=64, grammar_max_whitespace=2)
        prefill = EngineCore(embedded_artifact, num_kv_blocks=64)
        transport = InProcTransport()
        role = DecodeRole(decode, transport)
        sender = PrefillRole(prefill, lambda endpoint: transport, threaded=False)
        tok = decode.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A person as JSON."}]),
                            add_special_tokens=False)
        schema = GrammarSpec.json_schema(PERSON)
        desc = role.add_request("c", prompt, SamplingParams(temperature=0.0, max_tokens=200,
                                                            structured_output=schema), "t0")
        assert desc is None
        assert role.decisions["local:grammar_compiling"] == 1
        plain = role.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=8), "t1")
        assert plain is not None and role.decisions["remote"] == 1
        sender.add("t1", prompt, plain)

        text: dict[str, list[int]] = {"c": [], "p": []}
        finish = {}
        for _ in range(2000):
            if prefill.has_unfinished_requests():
                prefill.step()
            role.poll()
            if not decode.has_unfinished_requests() and not role.pending:
                break
            for d in decode.step():
                text[d.request_id].extend(d.token_ids)
                if d.finish_reason is not None:
                    finish[d.request_id] = d.finish_reason
        else:
            raise AssertionError("the decode core did not finish")
        assert finish == {"c": "stop", "p": "length"}
        assert len(text["p"]) == 8
        jsonschema.validate(json.loads(tok.decode(text["c"], skip_special_tokens=True)), PERSON)
        assert role.check()["leased"] == 0
    finally:
        torch.set_num_threads(threads)
