"""A stand-in artifact: what the compiler will write, built by hand so the runtime is testable on its own.

The model is a 2-layer GQA attention network whose attention reads K/V back *through the paged cache*
(written at slot_mapping, gathered via block_tables), so any paging bug changes the logits. `dense_logits`
is an independent, cache-free forward of the same weights: the numerical reference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 2, 16, 2, 128
BLOCK_SIZE, MAX_MODEL_LEN = 4, 256

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small kiln that baked models into artifacts.",
    "Paged attention stores keys and values in fixed size blocks.",
    "héllo wörld, ça va? naïve café crème brûlée",
    "日本語のテキストと絵文字 🙂🚀 も含む",
    "Привет, как дела? Всё хорошо.",
] * 4

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}\n"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}\n"
    "<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MODEL_PY = '''\
"""Stand-in for a generated executor: 2-layer GQA attention over the paged KV cache."""
import math

import torch

from .kernels import cpu as K

HEADS, KV_HEADS, HEAD_DIM = {heads}, {kv_heads}, {head_dim}


class Model:
    def __init__(self, weights, device):
        self.w = {{k: v.to(device) for k, v in weights.items()}}
        self.num_layers = sum(1 for k in weights if k.endswith(".wq"))

    def forward(self, batch, kv_caches):
        w = self.w
        h = w["embed"][batch.input_ids.long()] + w["pos"][batch.positions.long()]
        T = h.shape[0]
        block_size = kv_caches[0].shape[2]
        blk = batch.slot_mapping // block_size
        off = batch.slot_mapping % block_size
        qsl = batch.query_start_loc.tolist()
        for i, cache in enumerate(kv_caches):
            x = K.rms_norm(h, w[f"l{{i}}.norm"])
            q = (x @ w[f"l{{i}}.wq"].T).view(T, HEADS, HEAD_DIM)
            k = (x @ w[f"l{{i}}.wk"].T).view(T, KV_HEADS, HEAD_DIM)
            v = (x @ w[f"l{{i}}.wv"].T).view(T, KV_HEADS, HEAD_DIM)
            cache[blk, 0, off] = k.to(cache.dtype)
            cache[blk, 1, off] = v.to(cache.dtype)
            out = torch.empty(T, HEADS, HEAD_DIM, dtype=h.dtype)
            for b in range(batch.num_seqs):
                s, e, n = qsl[b], qsl[b + 1], int(batch.seq_lens[b])
                blocks = batch.block_tables[b, : (n + block_size - 1) // block_size].long()
                assert (blocks >= 0).all(), "block table shorter than seq_len"
                keys = cache[blocks, 0].reshape(-1, KV_HEADS, HEAD_DIM)[:n].to(h.dtype)
                vals = cache[blocks, 1].reshape(-1, KV_HEADS, HEAD_DIM)[:n].to(h.dtype)
                keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
                vals = vals.repeat_interleave(HEADS // KV_HEADS, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[s:e], keys) / math.sqrt(HEAD_DIM)
                pos = batch.positions[s:e].long()
                mask = torch.arange(n)[None, :] > pos[:, None]
                scores = scores.masked_fill(mask[None], float("-inf"))
                out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
            h = h + out.reshape(T, -1) @ w[f"l{{i}}.wo"].T
            x = K.rms_norm(h, w[f"l{{i}}.mlp_norm"])
            h = h + K.silu(x @ w[f"l{{i}}.w1"].T) @ w[f"l{{i}}.w2"].T
        h = K.rms_norm(h[batch.logits_indices.long()], w["norm"])
        return (h @ w["lm_head"].T).float()
'''

KERNELS_PY = '''\
import torch


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def silu(x):
    return torch.nn.functional.silu(x)
'''


def build_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out_dir.mkdir(parents=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return tok.get_vocab_size()


def make_weights(vocab: int, seed: int = 0, max_model_len: int = MAX_MODEL_LEN) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"embed": rand(vocab, HIDDEN, std=1.0), "pos": rand(max_model_len, HIDDEN, std=0.5),
         "norm": 1 + rand(HIDDEN, std=0.1), "lm_head": rand(vocab, HIDDEN, std=0.6)}
    for i in range(LAYERS):
        w[f"l{i}.norm"] = 1 + rand(HIDDEN, std=0.1)
        w[f"l{i}.mlp_norm"] = 1 + rand(HIDDEN, std=0.1)
        w[f"l{i}.wq"] = rand(HEADS * HEAD_DIM, HIDDEN, std=0.3)
        w[f"l{i}.wk"] = rand(KV_HEADS * HEAD_DIM, HIDDEN, std=0.3)
        w[f"l{i}.wv"] = rand(KV_HEADS * HEAD_DIM, HIDDEN, std=1 / math.sqrt(HIDDEN))
        w[f"l{i}.wo"] = rand(HIDDEN, HEADS * HEAD_DIM, std=1 / math.sqrt(HIDDEN))
        w[f"l{i}.w1"] = rand(FFN, HIDDEN, std=1 / math.sqrt(HIDDEN))
        w[f"l{i}.w2"] = rand(HIDDEN, FFN, std=1 / math.sqrt(FFN))
    return w


def write_artifact(path: Path, max_model_len: int = MAX_MODEL_LEN) -> Path:
    """The stand-in artifact in `path`; `max_model_len` positions (its learned position table's rows)."""
    vocab = build_tokenizer(path / "tokenizer")
    (path / "__init__.py").write_text("")
    (path / "model.py").write_text(MODEL_PY.format(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM))
    (path / "kernels").mkdir()
    (path / "kernels" / "__init__.py").write_text("")
    (path / "kernels" / "cpu.py").write_text(KERNELS_PY)
    (path / "weights" / "rank0").mkdir(parents=True)
    save_file(make_weights(vocab, max_model_len=max_model_len), str(path / "weights" / "rank0" / "model.safetensors"))
    from kiln.codegen.artifact import weights_index  # what kiln compile records: a sha256 and header per file

    manifest = {
        "schema_version": 2, "kiln_version": "0.1.0", "target": "cpu", "device": "cpu", "dtype": "float32",
        "model": {"name": "standin", "config": {"hidden": HIDDEN, "layers": LAYERS}},
        "runtime": {"vocab_size": vocab, "max_model_len": max_model_len, "bos_token_id": 1, "eos_token_ids": [2]},
        "kv_cache": {"num_layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                     "dtype": "float32", "layout": ["num_blocks", 2, "block_size", "kv_heads", "head_dim"],
                     "memory_fraction": 0.9, "num_blocks": None, "pool_bytes": 256 * 2**20,
                     "bytes_per_token": LAYERS * 2 * KV_HEADS * HEAD_DIM * 4},
        "scheduler": {"max_seqs": 256, "max_batched_tokens": 8192, "chunked_prefill": 512, "policy": "fcfs",
                      "prefix_cache": "radix", "preemption": "recompute", "swap_space": 4 * 2**30,
                      "async_scheduling": None},
        "serve": {"host": "127.0.0.1", "port": 8000, "served_name": None},
        "speculative": {"method": None, "num_tokens": 1},
        "weights": {"dir": "weights/rank0", "files": ["model.safetensors"], "total_bytes": 0,
                    **weights_index(path / "weights" / "rank0", ["model.safetensors"])},
        "tokenizer": {"dir": "tokenizer"},
        "entry": {"module": "model", "class": "Model"},
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return path


def resave_weights(art: Path, weights: dict[str, torch.Tensor]) -> None:
    """Rewrites a one-file artifact's weights and re-records them in its manifest, as if they had been compiled
    so (a test poisoning a weight wants the load's digest check to pass, and the forward to see the poison)."""
    from kiln.codegen.artifact import weights_index

    wdir = art / "weights" / "rank0"
    save_file(weights, str(wdir / "model.safetensors"))
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["weights"].update(weights_index(wdir, ["model.safetensors"]))
    (art / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def dense_logits(w: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """Plain causal forward over the whole sequence, no KV cache: logits [len(token_ids), vocab]."""
    ids = torch.tensor(token_ids)
    n = len(token_ids)
    h = w["embed"][ids] + w["pos"][:n]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(LAYERS):
        x = _rms(h, w[f"l{i}.norm"])
        q = (x @ w[f"l{i}.wq"].T).view(n, HEADS, HEAD_DIM).transpose(0, 1)
        k = (x @ w[f"l{i}.wk"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
        v = (x @ w[f"l{i}.wv"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=0)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=0)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        h = h + att.transpose(0, 1).reshape(n, -1) @ w[f"l{i}.wo"].T
        x = _rms(h, w[f"l{i}.mlp_norm"])
        h = h + torch.nn.functional.silu(x @ w[f"l{i}.w1"].T) @ w[f"l{i}.w2"].T
    return _rms(h, w["norm"]) @ w["lm_head"].T


def dense_greedy(w: dict[str, torch.Tensor], prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(dense_logits(w, ids)[-1].argmax()))
    return ids[len(prompt):]
