"""The structured-output processor on CUDA logits: the bitmask is filled on the host (pinned), copied without a
sync and applied by xgrammar's Triton kernel; the masked rows equal the CPU path's, the others are untouched."""
from __future__ import annotations

import pathlib

import pytest
import torch
from kiln.runtime.core.sequence import Sequence
from kiln.runtime.core.structured_output import GrammarBackend, GrammarSpec, StructuredOutputProcessor
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.thinking import ThinkingConfig
from kiln.runtime.tokenizer import Tokenizer

EMBEDDED = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embedded"
V = 4096


def _seq(request_id: str, output: list[int]) -> Sequence:
    return Sequence(seq_id=0, request_id=request_id, index=0, token_ids=[0, 3, *output], num_prompt_tokens=2,
                    params=SamplingParams(), max_tokens=64, arrival=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mask_equals_cpu_mask(dtype):
    tok = Tokenizer.from_dir(EMBEDDED)
    backend = GrammarBackend(tok, V, [1, 4])
    try:
        compiled = backend.compile(GrammarSpec.json_schema(
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, whitespace="any"))
        prefix = tok.encode('{"a": 1', add_special_tokens=False)  # a space: allowed under "any"
        think = ThinkingConfig(start_ids=(5,), end_ids=(6,), force_ids=(6,), budget=0)
        masks = {}
        for device in ("cpu", "cuda"):
            p = StructuredOutputProcessor(backend, V, device=device, max_rows=2)
            p.add_request("json", grammar=compiled)
            p.add_request("budget", thinking=think)
            seqs = [_seq("free", [7]), _seq("json", prefix), _seq("budget", [9]), _seq("free2", [])]
            logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
            before = logits.clone()
            p(logits, seqs)
            torch.cuda.synchronize()
            assert torch.equal(logits[0], before[0]) and torch.equal(logits[3], before[3])
            masks[device] = logits.cpu()
        assert torch.equal(masks["cpu"], masks["cuda"])
        assert torch.nonzero(torch.isfinite(masks["cuda"][2].float())).flatten().tolist() == [6]
    finally:
        backend.close()
