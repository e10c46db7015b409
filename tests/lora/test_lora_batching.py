"""Mixed-adapter batches: every request gets exactly the tokens it gets alone, whatever else shares its step,
whether its adapter was resident or paged in (LRU over a fixed number of slots), and the prefix cache never
hands one adapter's K/V to another."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime.errors import RequestError
from lora_testlib import ATTENTION, ATTENTION_MLP

import kiln

GREEDY = kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_8_over_4_adapters_and_the_base(adapter, compile_lora):
    adapters = {f"a{k}": adapter(ATTENTION_MLP if k % 2 else ATTENTION, seed=10 + k) for k in range(4)}
    art = compile_lora("max_loras = 4; max_rank = 8", adapters)
    llm = kiln.LLM(str(art))
    prompts = _prompts(8)
    names = ["a0", None, "a1", "a2", None, "a3", "a0", "a2"]
    batch = llm.generate(prompts, GREEDY, lora=names)
    alone = [llm.generate([p], GREEDY, lora=n)[0] for p, n in zip(prompts, names, strict=True)]
    assert _tokens(batch) == _tokens(alone)
    for b, a in zip(batch, alone, strict=True):
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=0)
    # the adapters matter: the same prompt under each adapter and the base decodes differently
    same = [llm.generate([prompts[0]], GREEDY, lora=n)[0].outputs[0].token_ids for n in ("a0", "a1", "a2", "a3", None)]
    assert len({tuple(t) for t in same}) == 5


def test_16_adapters_in_4_slots_keep_outputs_under_eviction(adapter, compile_lora):
    art = compile_lora("max_loras = 4; max_rank = 8")
    paths = {f"x{k}": adapter(ATTENTION_MLP if k % 3 else ATTENTION, seed=100 + k) for k in range(16)}
    roomy = kiln.LLM(str(compile_lora("max_loras = 16; max_rank = 8")))  # every adapter resident: no paging
    tight = kiln.LLM(str(art))
    for llm in (roomy, tight):
        for name, path in paths.items():
            llm.engine.load_lora_adapter(name, str(path))
    prompts = _prompts(24, seed=1)
    names = [f"x{(k * 7) % 16}" for k in range(24)]
    want = _tokens(roomy.generate(prompts, GREEDY, lora=names))
    got = _tokens(tight.generate(prompts, GREEDY, lora=names))
    assert got == want
    # 16 adapters went through 4 slots: at least 12 evictions
    assert tight.engine.lora.num_loads >= 16 and len(tight.engine.lora._slot_of) == 4
    # and alone, one request after another: each adapter paged in again over the ones resident now
    loads = tight.engine.lora.num_loads
    for k in (0, 5, 23, 9, 2):
        assert _tokens(tight.generate([prompts[k]], GREEDY, lora=names[k])) == [want[k]]
    assert tight.engine.lora.num_loads > loads


def test_prefix_cache_keys_include_the_adapter(adapter, compile_lora):
    art = compile_lora("max_loras = 2; max_rank = 8", {"a": adapter(ATTENTION, seed=7)})
    prompt = _prompts(1, seed=3, lo=60, hi=61)[0]  # several full blocks of 16
    fresh = kiln.LLM(str(art)).generate([prompt], GREEDY, lora="a")[0].outputs[0].token_ids
    llm = kiln.LLM(str(art))
    base = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids  # fills the prefix cache with base K/V
    hits = llm.engine.block_manager.prefix_cache.hits
    assert llm.generate([prompt], GREEDY, lora="a")[0].outputs[0].token_ids == fresh != base
    assert llm.engine.block_manager.prefix_cache.hits == hits, "an adapter reused the base model's blocks"
    assert llm.generate([prompt], GREEDY, lora="a")[0].outputs[0].token_ids == fresh  # its own blocks: reused
    assert llm.engine.block_manager.prefix_cache.hits > hits


def test_unknown_adapter_and_unload_while_in_use(adapter, compile_lora):
    art = compile_lora("max_loras = 2; max_rank = 8", {"a": adapter(ATTENTION, seed=7)})
    llm = kiln.LLM(str(art))
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
        llm.generate([[5, 6, 7]], GREEDY, lora="nope")
    engine = llm.engine
    engine.add_request("busy", [5, 6, 7], GREEDY, lora_name="a")
    with pytest.raises(RequestError, match="in use"):
        engine.unload_lora_adapter("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora_adapter("a")
    assert engine.list_lora_adapters() == []
    with pytest.raises(RequestError, match="no LoRA adapter named 'a'"):
        llm.generate([[5, 6, 7]], GREEDY, lora="a")
    # reloaded under the same name it is another adapter: nothing cached for the old one is reused
    engine.load_lora_adapter("a", str(adapter(ATTENTION_MLP, seed=8)))
    assert llm.generate([[5, 6, 7]], GREEDY, lora="a")[0].outputs[0].token_ids


def test_base_only_artifact_refuses_adapters(compile_hf):
    _, art, _ = compile_hf("llama")
    llm = kiln.LLM(str(art))
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        llm.generate([[5, 6, 7]], GREEDY, lora="a")
    with pytest.raises(RequestError, match="without `lora"):
        llm.engine.load_lora_adapter("a", "/nonexistent")
