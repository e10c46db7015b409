"""EAGLE-3 speculative decoding: a random head saved by the test in the published layout (config.json with
`LlamaForCausalLMEagle3` and `draft_vocab_size`; fc.weight [hidden, 3*hidden], midlayer.* whose q/k/v read
2*hidden, norm.weight, lm_head.weight over a draft vocabulary, d2t / t2d) over the tiny 2-layer random Llama.

The target's model.py returns the hidden states entering the layers asked for (HF's hidden_states); the head's
logits and chained drafts equal an independent torch reference written here from the layout (1e-4, fp32);
greedy outputs equal plain decoding and HF transformers' greedy tokens, for a random head and for one built to
agree with the target where it repeats a token (drafts accepted and rejected, counted consistently); the recipe
stores the head in the artifact's eagle/; bad heads are refused at the recipe's place, or at load."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from spec_testlib import (
    assert_all_blocks_free,
    assert_refused_at_section,
    greedy,
    hf_greedy,
    prompts,
    run,
    tokens,
)

MAX_TOKENS = (24, 7, 24, 13)
LAYER_IDS = [0, 1, 2]  # the 2-layer target: entering layers 0 and 1, and the last layer's output
DRAFT_VOCAB = 384  # of the target's 512


def save_eagle3_head(out: pathlib.Path, target_ckpt: pathlib.Path, *, seed: int = 0, agree: bool = False,
                     hidden: int | None = None, config: dict | None = None, extra: dict | None = None,
                     drop: tuple[str, ...] = ()) -> pathlib.Path:
    """A random EAGLE-3 head for the Llama checkpoint `target_ckpt`: a draft vocabulary of DRAFT_VOCAB target ids
    (a random sorted subset, so d2t's offsets differ), layers LAYER_IDS. `agree`: fc passes the target's last
    layer output through, the layer adds nothing (zero o_proj and down_proj) and the final norm and LM head are the
    target's (its rows of the draft vocabulary), so each draft is the target's greedy token for the token already
    known, where that token is in the draft vocabulary: right wherever the target repeats a token."""
    from safetensors.torch import load_file, save_file

    tcfg = json.loads((target_ckpt / "config.json").read_text())
    h = hidden or tcfg["hidden_size"]
    heads, kv_heads, ffn, vocab = 4, 2, 96, tcfg["vocab_size"]
    head_dim = h // heads
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": rand(h, 3 * h, scale=0.1),
         **{f"midlayer.{n}.weight": 1.0 + rand(h, scale=0.3)
            for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
         "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
         "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
         "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
         "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
         "midlayer.mlp.gate_proj.weight": rand(ffn, h), "midlayer.mlp.up_proj.weight": rand(ffn, h),
         "midlayer.mlp.down_proj.weight": rand(h, ffn),
         "norm.weight": 1.0 + rand(h, scale=0.3), "lm_head.weight": rand(DRAFT_VOCAB, h, scale=0.3),
         "d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)}
    eps = 1e-5
    if agree:
        target = load_file(str(target_ckpt / "model.safetensors"))
        w["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)
        for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
            w[name] = torch.zeros_like(w[name])
        w["norm.weight"], w["lm_head.weight"] = target["model.norm.weight"], target["lm_head.weight"][ids]
        eps = tcfg["rms_norm_eps"]
    for name in drop:
        w.pop(name)
    w.update(extra or {})
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": ffn,
           "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": eps, "rope_theta": 10000.0,
           "max_position_embeddings": tcfg["max_position_embeddings"], "vocab_size": vocab,
           "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
           "eagle_aux_hidden_state_layer_ids": LAYER_IDS, **(config or {})}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Eagle3Reference:
    """EAGLE-3's draft model from its published layout in plain torch (no kiln code): g = fc([a_1; a_2; a_3]) of
    the target's auxiliary hidden states; o = h + MLP(post_norm(h)), h = g + Attn([in_norm(E(x_{t+1}));
    hidden_norm(g)]) with causal GQA attention and rotary embeddings over positions 0..n-1; logits =
    lm_head(norm(o)) over the draft vocabulary; a draft id d is target id d + d2t[d]. Recomputed over the whole
    sequence each time (no KV cache)."""

    def __init__(self, head_dir: pathlib.Path):
        from safetensors.torch import load_file

        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.w = load_file(str(head_dir / "model.safetensors"))
        self.eps = self.cfg["rms_norm_eps"]

    def fc(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(aux, -1) @ self.w["fc.weight"].T

    def hidden(self, embeds: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        w, c, eps, n = self.w, self.cfg, self.eps, embeds.shape[0]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // heads
        x = torch.cat([rms_norm(embeds, w["midlayer.input_layernorm.weight"], eps),
                       rms_norm(g, w["midlayer.hidden_norm.weight"], eps)], -1)
        q, k, v = (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv")
        q, k, v = q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)
        inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
        cos, sin = (torch.cat([f(angles)] * 2, -1).float()[:, None] for f in (torch.cos, torch.sin))

        def rotate(t):
            return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

        q, k = rotate(q), rotate(k)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
        h = g + a @ w["midlayer.self_attn.o_proj.weight"].T
        x = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = (x @ w[f"midlayer.mlp.{p}_proj.weight"].T for p in ("gate", "up"))
        return h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return rms_norm(o, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T

    def target_id(self, draft_id: int) -> int:
        return draft_id + int(self.w["d2t"][draft_id])


def hf_layer_states(hf, prompt: list[int]) -> tuple[list[torch.Tensor], int]:
    """The hidden states entering each decoder layer of the HF model over `prompt` (HF's hidden_states[j]), then
    the last layer's output (before the final norm, which HF's last hidden_states entry has applied), and its
    greedy next token."""
    last = []
    hook = hf.model.layers[-1].register_forward_hook(lambda m, i, o: last.append(o[0] if isinstance(o, tuple) else o))
    try:
        out = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    finally:
        hook.remove()
    layers = len(hf.model.layers)
    states = [s[0] for s in out.hidden_states[:layers]] + [last[0].reshape(len(prompt), -1)]
    return states, int(out.logits[0, -1].argmax())


@pytest.fixture(scope="module")
def target(compile_hf):
    ckpt, art, _ = compile_hf("llama")
    return ckpt, art


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_heads")
    return {"random": save_eagle3_head(root / "random", target[0]),
            "agree": save_eagle3_head(root / "agree", target[0], agree=True)}


@pytest.fixture(scope="module")
def hf(target, tiny_checkpoint_lib):
    with torch.no_grad():
        return tiny_checkpoint_lib.load_hf_model(target[0]).float().eval()


@pytest.fixture(scope="module")
def plain(target, hf):
    """Plain greedy decoding's tokens of the four prompts, which are HF transformers' greedy tokens."""
    outs, _, _ = run(target[1], [greedy(m) for m in MAX_TOKENS], speculative=None)
    want = [hf_greedy(hf, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    assert tokens(outs) == want
    return want


def test_target_returns_the_hidden_states_entering_the_layers_asked_for(target, hf):
    """model.py's forward(aux_layers=...) gives HF's hidden_states entering each layer asked for (in that order,
    repeats allowed; NUM_LAYERS: the last layer's output), and the logits it gives without them."""
    from kiln.runtime.artifact import load_artifact
    from kiln.runtime.forward_batch import ForwardBatch

    art = load_artifact(target[1])
    prompt = prompts()[1]
    n, kv = len(prompt), art.kv_cache_config
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731

    def forward(**kw):
        caches = [torch.zeros((4, *kv.shape), dtype=kv.dtype) for _ in range(kv.num_layers)]
        fb = ForwardBatch(input_ids=i32(prompt), positions=i32(list(range(n))), query_start_loc=i32([0, n]),
                          seq_lens=i32([n]), block_tables=i32([[0, 1, 2, 3]]),
                          slot_mapping=torch.arange(n), logits_indices=i32([n - 1]))
        return art.model.forward(fb, caches, **kw)

    assert sys.modules[type(art.model).__module__].NUM_LAYERS == 2
    logits, aux = forward(aux_layers=(2, 0, 1, 0))
    with torch.no_grad():
        states, _ = hf_layer_states(hf, prompt)
    assert len(aux) == 4
    for got, j in zip(aux, (2, 0, 1, 0), strict=True):
        torch.testing.assert_close(got, states[j], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, forward(), atol=0, rtol=0)


def test_logits_and_chained_drafts_match_the_reference(target, heads, hf):
    """One prefill step of a prompt through the engine: its 4 chained drafts equal the reference's (which
    recomputes the head over the whole sequence at each draft, from HF's hidden states), and the head's fused
    hidden states, and its draft-vocabulary logits over the prompt and the chained rows, equal the reference's."""
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.worker.interface import DraftInput

    prompt = prompts()[2]
    n = len(prompt)
    ref = Eagle3Reference(heads["random"])
    with torch.no_grad():
        states, first = hf_layer_states(hf, prompt)
        aux = [states[j] for j in LAYER_IDS]
        embed = hf.get_input_embeddings().weight
        es, gs = embed[prompt[1:] + [first]], ref.fc(aux)
        o = ref.hidden(es, gs)
        prompt_logits, draft_ids, want = ref.logits(o), [], []
        for _ in range(4):
            draft_ids.append(int(ref.logits(o[-1]).argmax()))
            want.append(ref.target_id(draft_ids[-1]))
            es, gs = torch.cat([es, embed[want[-1:]]]), torch.cat([gs, o[-1:]])
            o = ref.hidden(es, gs)
    engine = LLMEngine(target[1], speculative="eagle", num_speculative_tokens=4,
                       speculative_model=str(heads["random"]), num_kv_blocks=16)
    head = engine.speculator.proposer.head
    assert engine.speculator.proposer.aux_layers == tuple(LAYER_IDS)
    engine.add_request("0", prompt, greedy(8))
    engine.step()
    seq = engine.scheduler.running[0]
    assert seq.token_ids[-1] == first and seq.draft_token_ids == want
    assert len(set(want)) > 1 and want != draft_ids  # drafts differ, and d2t moved them into the target's ids
    with torch.no_grad():
        torch.testing.assert_close(head.start(DraftInput(None, None, aux), torch.arange(n)), gs[:n],
                                   atol=1e-4, rtol=0)
        got, _, _ = head.step(es, gs, torch.arange(n + 4))
        torch.testing.assert_close(head.logits(got), ref.logits(o), atol=1e-4, rtol=0)
        torch.testing.assert_close(head.logits(got[:n]), prompt_logits, atol=1e-4, rtol=0)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("which, k", [("random", 3), ("agree", 1), ("agree", 4)])
def test_greedy_equals_plain_and_hf_decoding(target, heads, plain, which, k):
    """The four prompts as one batch: HF's greedy tokens; the metrics agree with what came out (every step a
    request gains tokens it gains the target's token and that step's accepted drafts); the agreeing head's
    drafts are accepted and rejected."""
    from kiln.runtime.llm_engine import LLMEngine

    engine = LLMEngine(target[1], num_kv_blocks=64, speculative="eagle", num_speculative_tokens=k,
                       speculative_model=str(heads[which]))
    for i, (prompt, m) in enumerate(zip(prompts(), MAX_TOKENS, strict=True)):
        engine.add_request(str(i), prompt, greedy(m))
    got: dict[str, list[int]] = {}
    gains = 0  # (request, step) pairs where the request gained tokens
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            gains += len(ids) > len(got.get(out.request_id, []))
            got[out.request_id] = list(ids)
    assert [got[str(i)] for i in range(len(MAX_TOKENS))] == plain
    s = engine.stats()
    drafts, drafted, accepted = s["spec_num_drafts"], s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]
    assert sum(MAX_TOKENS) == gains + accepted
    assert 0 < drafts <= drafted <= k * drafts and 0 <= accepted <= drafted
    assert s["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert s["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    if which == "agree":
        assert 0 < accepted < drafted
    assert_all_blocks_free(engine)


def test_recipe_compiles_the_head_into_the_artifact(compile_hf, target, heads, plain):
    """`speculative { method = eagle; draft = "hf:DIR" }` with an EAGLE-3 head: checked, stored in eagle/ with its
    own LM head and d2t (no copy of the target's embedding), and served from there."""
    from safetensors import safe_open

    section = ("  serve ", f'  speculative {{ method = eagle; tokens = 2; draft = "hf:{heads["agree"]}" }}\n'
                           "  serve ")
    _, art, _ = compile_hf("llama", edits=(section,))
    assert json.loads((art / "manifest.json").read_text())["speculative"]["draft_model"] == "eagle"
    with safe_open(str(art / "eagle" / "model.safetensors"), "pt") as f:
        assert {"fc.weight", "lm_head.weight", "d2t", "midlayer.hidden_norm.weight"} <= set(f.keys())
    outs, _, engine = run(art, [greedy(m) for m in MAX_TOKENS])
    assert engine.speculator.proposer.aux_layers == tuple(LAYER_IDS)
    assert tokens(outs) == plain and engine.stats()["spec_num_accepted_tokens"] > 0


def test_auxiliary_layers_as_vllm_and_sglang_read_them(target, tmp_path):
    """Top-level eagle_aux_hidden_state_layer_ids as vLLM reads them (the hidden state entering layer j),
    SGLang's `eagle_config` ones as layer outputs (j + 1), else (2, L // 2, L - 3); each checked against the
    target's depth and fc's width."""
    from kiln.runtime.core.speculative.eagle3 import read_eagle3_checkpoint

    head = save_eagle3_head(tmp_path / "h", target[0], config={"eagle_aux_hidden_state_layer_ids": [1, 15, 31]})
    assert read_eagle3_checkpoint(head)[0].aux_layers(32) == (1, 15, 31)
    cfg = json.loads((head / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (head / "config.json").write_text(json.dumps({**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                             [1, 15, 31]}}))
    assert read_eagle3_checkpoint(head)[0].aux_layers(32) == (2, 16, 32)
    (head / "config.json").write_text(json.dumps(cfg))
    shape = read_eagle3_checkpoint(head)[0]
    assert shape.aux_layers(32) == (2, 16, 29) and shape.aux_layers(7) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"\[2, 1, -1\]: \[-1\] outside the target's 0..2"):
        shape.aux_layers(2)


def _refused(make, target, tiny_checkpoint, tmp_path, capsys, needle):
    head = make(tmp_path / "head", target[0])
    assert_refused_at_section(tiny_checkpoint("llama"), f'speculative {{ method = eagle; tokens = 2; draft = "hf:{head}" }}',
                              tmp_path, capsys, needle)


@pytest.mark.parametrize("make, needle", [
    (lambda d, ck: save_eagle3_head(d, ck, drop=("midlayer.hidden_norm.weight",)),
     "missing midlayer.hidden_norm.weight"),
    (lambda d, ck: save_eagle3_head(d, ck, extra={"lm_head.weight": torch.zeros(DRAFT_VOCAB + 1, 64)}),
     f"lm_head.weight is [{DRAFT_VOCAB + 1}, 64], expected [{DRAFT_VOCAB}, 64]"),
    (lambda d, ck: save_eagle3_head(d, ck, extra={"fc.weight": torch.zeros(64, 128)}),
     "3 auxiliary layers [0, 1, 2] for an fc that fuses 2 hidden states"),
    (lambda d, ck: save_eagle3_head(d, ck, hidden=32), "hidden_size 32, the target's is 64"),
    (lambda d, ck: save_eagle3_head(d, ck, config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}),
     "[5] outside the target's 0..2"),
    (lambda d, ck: save_eagle3_head(d, ck, extra={"d2t": torch.full((DRAFT_VOCAB,), 200)}),
     "d2t maps draft ids outside the vocabulary 0..511"),
    (lambda d, ck: save_eagle3_head(d, ck, extra={"midlayer.self_attn.q_norm.weight": torch.ones(16)}),
     "midlayer.self_attn.q_norm.weight are not those of an EAGLE-3 head"),
], ids=["missing", "lm_head", "fc", "hidden", "layers", "d2t", "unknown"])
def test_bad_heads_are_refused_at_their_place(target, tiny_checkpoint, tmp_path, capsys, make, needle):
    _refused(make, target, tiny_checkpoint, tmp_path, capsys, needle)


def test_a_parallel_target_is_refused_at_the_head(target, heads, tiny_checkpoint, tmp_path, capsys):
    assert_refused_at_section(tiny_checkpoint("llama"), "parallel { tp = 2 }\n  speculative { method = eagle; "
                              f'tokens = 2; draft = "hf:{heads["random"]}" }}', tmp_path, capsys,
                              "EAGLE-3 head on a parallel artifact (tp x dp = 2) is not implemented yet")


def test_bad_heads_are_refused_at_load(target, heads, tmp_path):
    """`kiln serve --speculative eagle --speculative-model DIR` checks the head against the loaded target as the
    compiler does; a model.py without NUM_LAYERS (an older kiln's) cannot feed one."""
    from types import SimpleNamespace

    from kiln.runtime.core.speculative.eagle3 import load_eagle3_head
    from kiln.runtime.errors import ArtifactError
    from kiln.runtime.llm_engine import LLMEngine

    head = save_eagle3_head(tmp_path / "h", target[0], hidden=32)
    with pytest.raises(ArtifactError, match="hidden_size 32, the target's is 64"):
        LLMEngine(target[1], speculative="eagle", speculative_model=str(head), num_kv_blocks=8)
    with pytest.raises(ArtifactError, match="no NUM_LAYERS"):
        load_eagle3_head(heads["random"], SimpleNamespace(model=SimpleNamespace(), path="art"), None)
