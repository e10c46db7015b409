"""EAGLE-1/2 speculative decoding: a random one-layer head saved by the test in SafeAILab's published layout
(config.json, fc.weight [hidden, 2*hidden] + bias, layers.0.* without input_layernorm) over a tiny random Llama.
The head's features and chained drafts equal a reference built from HF's LlamaDecoderLayer by the EAGLE
equations; greedy outputs equal plain decoding for k = 1, 2, 4 whether its drafts are mostly right or mostly
wrong; sampled verification of 4 drafts keeps the target distribution; the recipe compiles the head into the
artifact's eagle/; mismatched heads are refused at their place; /metrics labels it eagle; a batch of
sequences gets the drafts each gets alone; a target with a packed tied embedding (TVM) runs it."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
from spec_testlib import (
    assert_all_blocks_free,
    assert_refused_at_section,
    check_four_sampled_drafts,
    greedy,
    prompts,
    run,
    spec_metrics,
    tokens,
)


def save_eagle_head(out: pathlib.Path, target_ckpt: pathlib.Path, *, seed: int = 0, repeat: bool = False,
                    input_norm: bool = False, fmt: str = "safetensors", extra: dict | None = None) -> pathlib.Path:
    """A random EAGLE-1/2 head for the Llama checkpoint `target_ckpt`, in the published layout. `repeat`: fc
    passes the target's feature through and the layer adds nothing (zero o_proj/down_proj), so each draft is the
    target's choice for the token already known, right wherever the target repeats a token (random tiny models
    often do): drafts are accepted and rejected."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    tcfg = json.loads((target_ckpt / "config.json").read_text())
    h = tcfg["hidden_size"]
    cfg = {k: tcfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                                "rms_norm_eps", "vocab_size", "max_position_embeddings")}
    cfg["rope_theta"] = tcfg.get("rope_theta") or tcfg["rope_parameters"]["rope_theta"]  # published: top level
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, hidden_act="silu",
               bias=True)
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(LlamaConfig(**cfg), layer_idx=0)
    weights = {}
    for name, t in layer.state_dict().items():
        if name.startswith("input_layernorm") and not input_norm:
            continue
        t = 1.0 + 0.3 * torch.randn_like(t) if name.endswith("norm.weight") else torch.randn_like(t) * 0.08
        weights[f"layers.0.{name}"] = t
    weights["fc.weight"] = torch.randn(h, 2 * h) * 0.1
    weights["fc.bias"] = torch.randn(h) * 0.02
    if repeat:
        weights["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
        weights["fc.bias"] = torch.zeros(h)
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    weights.update(extra or {})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    else:
        torch.save(weights, out / "pytorch_model.bin")
    return out


class EagleReference(torch.nn.Module):
    """EAGLE's draft model from HF building blocks: f = Layer(fc([E(x_{t+1}); F_t])) with the first layer's
    input norm an identity, F_t the target's last hidden state (after its final norm), drafts argmax(W_lm f)."""

    def __init__(self, head_dir: pathlib.Path):
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        config = LlamaConfig(**json.loads((head_dir / "config.json").read_text()))
        config._attn_implementation = "eager"
        w = load_file(str(head_dir / "model.safetensors"))
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.fc.load_state_dict({"weight": w["fc.weight"], "bias": w["fc.bias"]})
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        state = {k.removeprefix("layers.0."): v for k, v in w.items() if k.startswith("layers.0.")}
        if "input_layernorm.weight" not in state:
            self.layer.input_layernorm = torch.nn.Identity()
        self.layer.load_state_dict(state)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features], -1))[None]
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))
        return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.fixture(scope="module")
def target(compile_hf):
    ckpt, art, _ = compile_hf("llama")
    return ckpt, art


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_heads")
    return {"random": save_eagle_head(root / "random", target[0]),
            "repeat": save_eagle_head(root / "repeat", target[0], repeat=True)}


@pytest.fixture(scope="module")
def plain(target):
    outs, _, _ = run(target[1], [greedy(m) for m in (24, 7, 24, 13)], speculative=None)
    return tokens(outs)


def test_head_features_and_chained_drafts_match_the_reference(target, heads, tiny_checkpoint_lib):
    """One prefill step of a prompt through the engine: the head's features over the prompt (its KV written) and
    its 4 chained drafts equal the reference's, which recomputes the whole head at each chained draft."""
    from kiln.runtime.llm_engine import LLMEngine

    ckpt, art = target
    prompt = prompts()[2]
    hf = tiny_checkpoint_lib.load_hf_model(ckpt).float().eval()
    ref = EagleReference(heads["random"]).eval()
    with torch.no_grad():
        first = int(hf(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
        feats = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]  # normed
        embed, lm_head = hf.get_input_embeddings().weight, hf.lm_head.weight
        toks = prompt[1:] + [first]
        f_ref = ref(embed[toks], feats)
        want, fs, es = [], feats, embed[toks]
        for _ in range(4):
            want.append(int((lm_head @ f_ref[-1]).argmax()))
            es, fs = torch.cat([es, embed[want[-1:]]]), torch.cat([fs, f_ref[-1:]])
            f_ref = ref(es, fs)
    engine = LLMEngine(art, speculative="eagle", num_speculative_tokens=4, speculative_model=str(heads["random"]),
                       num_kv_blocks=16)
    engine.add_request("0", prompt, greedy(8))
    engine.step()
    seq = engine.scheduler.running[0]
    assert seq.token_ids[-1] == first and seq.draft_token_ids == want
    head = engine.speculator.proposer.head
    with torch.no_grad():
        got, _, _ = head.step(embed[toks], feats, torch.arange(len(prompt)), None)
    torch.testing.assert_close(got, ref(embed[toks], feats), atol=1e-5, rtol=1e-5)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("which", ["random", "repeat"])
def test_greedy_equals_plain_decoding(target, heads, plain, k, which):
    outs, _, engine = run(target[1], [greedy(m) for m in (24, 7, 24, 13)], speculative="eagle",
                          num_speculative_tokens=k, speculative_model=str(heads[which]))
    assert tokens(outs) == plain
    s = engine.stats()
    assert s["spec_num_draft_tokens"] > 0
    if which == "repeat":
        assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    assert_all_blocks_free(engine)
    proposer = engine.speculator.proposer
    from kiln.runtime.core.batch import ScheduledBatch
    from kiln.runtime.core.speculative import Launched
    from kiln.runtime.worker.interface import DraftInput

    empty = Launched(sampled=None, new_tokens=[], draft_input=DraftInput(None, torch.zeros(0, 64)), starts=[])
    proposer.propose(ScheduledBatch(), empty, [], [])
    assert len(proposer.kv) == 0  # a later step drops the finished sequences' head KV


def test_preemption_and_penalties_equal_plain(target, heads, plain):
    outs, _, engine = run(target[1], [greedy(m) for m in (24, 7, 24, 13)], speculative="eagle",
                          num_speculative_tokens=3, speculative_model=str(heads["repeat"]), num_kv_blocks=6)
    assert engine.stats()["num_preemptions"] > 0
    assert tokens(outs) == plain
    params = [greedy(20, repetition_penalty=1.2, frequency_penalty=0.2, logprobs=2) for _ in range(4)]
    want, _, _ = run(target[1], params, speculative=None)
    got, _, _ = run(target[1], params, speculative="eagle", num_speculative_tokens=4,
                    speculative_model=str(heads["repeat"]))
    assert tokens(got) == tokens(want)


@pytest.mark.parametrize("fmt, input_norm", [("bin", True)])
def test_other_published_variants_load(target, plain, tmp_path, fmt, input_norm):
    """pytorch_model.bin, a first layer with input_layernorm, a `model.` prefix and a copy of the embedding."""
    ckpt = target[0]
    head = save_eagle_head(tmp_path / "h", ckpt, fmt=fmt, input_norm=input_norm, seed=3)
    w = torch.load(head / "pytorch_model.bin", weights_only=True)
    w = {f"model.{k}": v for k, v in w.items()}
    w["embed_tokens.weight"] = torch.zeros(512, 64)
    torch.save(w, head / "pytorch_model.bin")
    outs, _, engine = run(target[1], [greedy(m) for m in (24, 7, 24, 13)], speculative="eagle",
                          num_speculative_tokens=2, speculative_model=str(head))
    assert tokens(outs) == plain and engine.stats()["spec_num_draft_tokens"] > 0
    assert "layers.0.input_layernorm.weight" in engine.speculator.proposer.head.w


def test_verifying_four_sampled_drafts_keeps_the_target_distribution(target, heads):
    from kiln.runtime.llm_engine import LLMEngine

    check_four_sampled_drafts(LLMEngine(target[1], speculative="eagle", num_speculative_tokens=4,
                                        speculative_model=str(heads["random"]), num_kv_blocks=8, seed=11))


def test_recipe_compiles_the_head_into_the_artifact(compile_hf, target, heads, plain):
    section = ("  serve ", f'  speculative {{ method = eagle; tokens = 3; draft = "hf:{heads["repeat"]}" }}\n'
                           "  serve ")
    _, art, _ = compile_hf("llama", edits=(section,))
    spec = json.loads((art / "manifest.json").read_text())["speculative"]
    assert spec == {"method": "eagle", "num_tokens": 3, "draft_model": "eagle"}
    assert (art / "eagle" / "model.safetensors").is_file()
    assert json.loads((art / "eagle" / "kiln.json").read_text())["target_norm_eps"] == pytest.approx(1e-6, rel=0.5)
    outs, _, engine = run(art, [greedy(m) for m in (24, 7, 24, 13)])
    assert (engine.speculative.method, engine.speculative.num_tokens) == ("eagle", 3)
    assert tokens(outs) == plain and engine.stats()["spec_num_accepted_tokens"] > 0
    import argparse

    from kiln.runtime.entrypoint import add_serve_args
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--speculative", "eagle", "--speculative-model", "D", "--num-speculative-tokens", "2"])
    assert (args.speculative, args.speculative_model, args.num_speculative_tokens) == ("eagle", "D", 2)


@pytest.mark.parametrize("make, needle", [
    (lambda d, ck: save_eagle_head(d, ck, extra={"midlayer.self_attn.q_proj.weight": torch.zeros(4, 4),
                                                 "d2t": torch.zeros(4, dtype=torch.int64)}),
     "missing midlayer.input_layernorm.weight"),  # read as the EAGLE-3 head it half is (test_spec_eagle3.py)
    (lambda d, ck: save_eagle_head(d, ck, extra={"fc.weight": torch.zeros(64, 64)}),
     "fc.weight is [64, 64], expected [64, 128]"),
    (lambda d, ck: (save_eagle_head(d, ck), (d / "model.safetensors").unlink()),
     "no weights (model.safetensors or pytorch_model.bin)"),
    (lambda d, ck: None, "draft checkpoint directory"),
])
def test_bad_heads_are_refused_at_their_place(target, tiny_checkpoint, tmp_path, capsys, make, needle):
    head = tmp_path / "head"
    make(head, target[0])
    assert_refused_at_section(tiny_checkpoint("llama"), f'speculative {{ method = eagle; tokens = 2; draft = "hf:{head}" }}',
                              tmp_path, capsys, needle)


def test_eagle_without_a_head_is_refused(target):
    from kiln.runtime.errors import ArtifactError
    from kiln.runtime.llm_engine import LLMEngine

    with pytest.raises(ArtifactError, match="eagle needs a draft head"):
        LLMEngine(target[1], speculative="eagle", num_kv_blocks=8)


def test_acceptance_in_metrics_endpoint_labelled_eagle(target, heads):
    values, label = spec_metrics(target[1], {"speculative": "eagle", "num_speculative_tokens": 4,
                                             "speculative_model": str(heads["repeat"])}, prompts(), "eagle")
    drafts = values["kiln:spec_decode_num_drafts_total" + label]
    drafted = values["kiln:spec_decode_num_draft_tokens_total" + label]
    accepted = values["kiln:spec_decode_num_accepted_tokens_total" + label]
    assert 0 < drafts <= drafted <= 4 * drafts and 0 < accepted < drafted
    assert values["kiln:spec_decode_draft_acceptance_rate" + label] == pytest.approx(accepted / drafted)


def test_a_batch_drafts_for_each_sequence_what_it_drafts_alone(target, heads):
    """Four sequences of different lengths and budgets in one batch (the head's varlen forward over all their
    tokens, then one decode per chained draft over those still drafting) get, at every length, the drafts each
    gets when it runs alone; afterwards the head's pool is all free."""
    from kiln.runtime.core.batch import ScheduledBatch
    from kiln.runtime.core.speculative import Launched
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.worker.interface import DraftInput

    def drafts(engine, requests):
        got: dict[str, dict[int, list[int]]] = {}
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                got.setdefault(seq.request_id, {})[seq.num_tokens] = list(seq.draft_token_ids)
        return got

    requests = [(str(i), p, greedy(m)) for i, (p, m) in enumerate(zip(prompts(), (9, 5, 12, 3), strict=True))]
    engine = LLMEngine(target[1], speculative="eagle", num_speculative_tokens=4,
                       speculative_model=str(heads["random"]), num_kv_blocks=64, prefix_cache=None)
    batched = drafts(engine, requests)
    alone = {}
    for r in requests:
        alone.update(drafts(engine, [r]))
    assert batched == alone
    assert sum(len(d) for seq in batched.values() for d in seq.values()) > 4 * len(requests)
    assert {len(d) for seq in batched.values() for d in seq.values()} >= {1, 4}  # limits differ near the end
    proposer = engine.speculator.proposer
    proposer.propose(ScheduledBatch(), Launched(sampled=None, new_tokens=[], draft_input=DraftInput(None, None),
                                                starts=[]), [], [])
    proposer.block_manager.check_invariants([])
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_eagle_on_a_target_whose_tied_embedding_is_packed(embedded, doc_prompts, tmp_path):
    """The embedded model compiled for the cpu target holds its tied embedding / LM head in the TVM GEMM's packed
    layout, which the head reads through the target's kernels (K.embedding, K.logits): greedy outputs equal
    plain decoding."""
    head = save_eagle_head(tmp_path / "head", pathlib.Path(__file__).resolve().parents[2] / "examples" / "embedded",
                           repeat=True)
    params = [greedy(12), greedy(9)]
    want, _, _ = run(embedded, params, doc_prompts[:2], speculative=None)
    got, _, engine = run(embedded, params, doc_prompts[:2], speculative="eagle", num_speculative_tokens=3,
                         speculative_model=str(head))
    assert not isinstance(engine.artifact.model.embed, torch.Tensor)  # the packed layout, not a tensor
    assert tokens(got) == tokens(want) and engine.stats()["spec_num_draft_tokens"] > 0
