"""Multi-LoRA on a tensor-parallel mesh: every rank holds its slice of the adapter slots (B's output rows of the
column-parallel q/k/v and gate/up, A's input columns of the row-parallel o and down, whose partial branch the
base's all_reduce sums) and pages adapters into the slots rank 0 chose; adapters loaded and unloaded at run
time reach every rank between steps.

Two adapters of different ranks (8 over attention + MLP, 4 over q/v/down) and the base model share one batch:
TP = 2 equals TP = 1 with the same adapters (fp32 prompt logprobs within 1e-4, greedy tokens identical) and
equals HF peft. The single-process mesh runs the TP = 2 and TP = 4 (KV heads replicated) parity, and the
refusal when another rank cannot read an adapter; `kiln serve`'s processes (an engine core with a gloo worker)
run the same parity over run-time load / unload through the server's endpoints (the rank commands are the
same code on both meshes: runtime/worker/distributed/commands.py)."""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from kiln.runtime.errors import RequestError
from lora_testlib import ATTENTION_MLP, peft_greedy, peft_logits

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

PROMPTS = [[5, 17, 33, 101, 7, 250, 9, 11, 400, 3, 77, 12], [44, 45, 46, 200, 8], [300, 5, 77, 120, 410, 9, 33]]
LORAS = ["a", "b", None]
NEW = 8
SECTION = "max_loras = 2; max_rank = 8"


def _params() -> kiln.SamplingParams:
    return kiln.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def adapters(adapter):
    return {"a": adapter(ATTENTION_MLP, seed=21, rank=8), "b": adapter(["q_proj", "v_proj", "down_proj"], seed=22,
                                                                      rank=4)}


@pytest.fixture(scope="module")
def compile_tp(compile_hf):
    """`compile_tp(mesh, adapters, quantize)`: tiny llama with `parallel { mesh }` (None: one device), `lora {
    SECTION; adapters }` and `quantize { weights = quantize }` if given."""
    def build(mesh: str | None, adapters: dict | None = None, quantize: str | None = None):
        entries = SECTION + ("; adapters = { " + ", ".join(f'{k}: "hf:{v}"' for k, v in adapters.items()) + " }"
                             if adapters else "")
        sections = ((f"  parallel  {{ {mesh} }}\n" if mesh else "") + f"  lora {{ {entries} }}\n"
                    + (f"  quantize  {{ weights = {quantize} }}\n" if quantize else ""))
        _, art, _ = compile_hf("llama", edits=(("  serve     {", sections + "  serve     {"),))
        return art

    return build


def _outputs(llm, prompts=PROMPTS, loras=LORAS):
    """(greedy tokens, prompt logprobs, text) per prompt."""
    outs = llm.generate(prompts, _params(), lora=loras)
    return [(o.outputs[0].token_ids, [o.prompt_logprobs[j][t].logprob for j, t in enumerate(p) if j > 0],
             o.outputs[0].text) for o, p in zip(outs, prompts, strict=True)]


def _assert_same(got, want) -> None:
    for (tokens, lp, _), (ref_tokens, ref_lp, _) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref_lp), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def single_device(adapters, compile_lora):
    """TP = 1 with the same adapters: the reference outputs of the mixed batch."""
    with kiln.LLM(str(compile_lora(SECTION, adapters))) as llm:
        return _outputs(llm)


@pytest.mark.parametrize("mesh", ["tp = 2", "tp = 4"])
def test_mesh_with_two_adapters_in_one_batch_equals_tp1_and_peft(mesh, adapters, compile_tp, single_device,
                                                                 tiny_checkpoint, tiny_checkpoint_lib, monkeypatch):
    monkeypatch.setenv("KILN_EXECUTOR", "local")
    art = compile_tp(mesh, adapters)
    with kiln.LLM(str(art), num_kv_blocks=64) as llm:
        got = _outputs(llm)
        _, b = llm.engine.lora.slot_weights["decoder.wqkv"]
        # rank 0's B rows: its query heads' 16 rows each, and its KV head's 16 rows of k and of v
        assert b.shape[2] == {"tp = 2": 2 * 16 + 16 + 16, "tp = 4": 16 + 16 + 16}[mesh]
    _assert_same(got, single_device)
    if mesh != "tp = 2":
        return
    ckpt, load = tiny_checkpoint("llama"), tiny_checkpoint_lib.load_hf_model
    for (_, lp, _), prompt, name in zip(got, PROMPTS, LORAS, strict=True):
        ref = peft_logits(ckpt, adapters.get(name), prompt, load).log_softmax(-1)
        want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-4, rtol=0)
        if name is not None:
            base = peft_logits(ckpt, None, prompt, load).log_softmax(-1)
            assert (ref - base).abs().max() > 0.05, "the adapter must move the logits for the test to mean anything"
    assert got[0][0] == peft_greedy(ckpt, adapters["a"], PROMPTS[0], NEW, load)


def test_quantized_base_on_the_mesh_takes_adapters(adapters, compile_tp, monkeypatch):
    """fp8 per-channel GEMMs on each rank's shard: the branch reads the GEMM's input and adds to its output, so
    TP = 2 equals TP = 1 over the same quantized weights."""
    q = "fp8(per_channel=true)"
    with kiln.LLM(str(compile_tp(None, adapters, q)), num_kv_blocks=64) as llm:
        want = _outputs(llm)
    monkeypatch.setenv("KILN_EXECUTOR", "local")
    with kiln.LLM(str(compile_tp("tp = 2", adapters, q)), num_kv_blocks=64) as llm:
        _assert_same(_outputs(llm), want)


def test_a_rank_that_cannot_read_the_adapter_refuses_the_load_everywhere(adapters, compile_tp, monkeypatch):
    from kiln.runtime.worker.lora import LoRAError

    monkeypatch.setenv("KILN_EXECUTOR", "local")
    with kiln.LLM(str(compile_tp("tp = 2")), num_kv_blocks=64) as llm:
        rank1 = llm.engine.runner.states[1].lora

        def unreadable(name, path, lora_id=None):
            raise LoRAError(f"{path}: cannot read it here")

        monkeypatch.setattr(rank1, "load", unreadable)
        with pytest.raises(RequestError, match="1 of the 1 other ranks could not read"):
            llm.engine.load_lora_adapter("a", str(adapters["a"]))
        assert llm.engine.list_lora_adapters() == [] and rank1.adapters == {}
        monkeypatch.undo()
        llm.engine.load_lora_adapter("a", str(adapters["a"]))  # readable now: served on both ranks
        assert list(rank1.adapters) == ["a"] and rank1.adapters["a"].lora_id == llm.engine.lora.lora_id("a")


def _complete(url: str, prompt: list[int], model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW,
                                                     "temperature": 0, "ignore_eos": True, "echo": True,
                                                     "logprobs": 0}, timeout=60)


def test_server_loads_and_unloads_adapters_on_gloo_ranks_while_serving(adapters, compile_tp, single_device):
    """`kiln serve`'s processes (the engine core in its own process, rank 1 a gloo worker of it): adapters loaded
    through POST /v1/load_lora_adapter after the start, used by concurrent requests, unloaded, and loaded again
    under another name; every completion equals TP = 1's (text, and prompt logprobs within 1e-4)."""
    from live_server import LiveServer

    art = compile_tp("tp = 2")  # no compiled-in adapters
    server = LiveServer(art, {"num_kv_blocks": 64, "lora_roots": [str(adapters["a"].parent)]})
    try:
        base = server.server_state.model_name

        def load(name: str, path) -> None:
            r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                           timeout=60)
            assert r.status_code == 200, r.text

        def check(names: list[str | None]) -> None:
            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: they share steps
                outs = list(pool.map(lambda pn: _complete(server.url, pn[0], pn[1] or base), zip(PROMPTS, names)))
            for out, (_, ref_lp, ref_text) in zip(outs, single_device, strict=True):
                assert out.status_code == 200, out.text
                choice = out.json()["choices"][0]
                lp = choice["logprobs"]["token_logprobs"][1:len(choice["logprobs"]["token_logprobs"]) - NEW]
                torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref_lp), atol=1e-4, rtol=0)
                assert choice["text"].endswith(ref_text)

        for name, path in adapters.items():
            load(name, path)
        check(LORAS)
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
        assert r.status_code == 200, r.text
        assert _complete(server.url, PROMPTS[0], "a").status_code == 404
        load("a2", adapters["a"])  # a new id, paged into the slot "a" left on both ranks
        check(["a2", "b", None])
    finally:
        server.stop()
