"""The `eagle` proposer: an EAGLE-1/2 draft head (SafeAILab's published layout) drafting k tokens a step.

The head is one Llama decoder layer after a projection `fc` of [embedding(token t+1); target feature at t]
(the target's last hidden state after its final norm) to a feature at t+1; the target's LM head turns a feature
into draft logits. It shares the target's embedding and LM head, and keeps the KV of its one layer itself. Drafts
2..k chain the head on its own output feature and the previous draft.

`read_checkpoint` checks a checkpoint directory (config.json and fc.weight / layers.0.* in model.safetensors or
pytorch_model.bin) and is what `kiln compile` runs for `speculative { method = eagle; draft = "hf:DIR" }` before
storing the head in the artifact's eagle/ (EAGLE_DIR).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import SpeculativeConfig
from ..errors import ArtifactError
from ..scheduler import ScheduledBatch
from . import Launched, Proposer, SeqStates

EAGLE_DIR = "eagle"  # the head's checkpoint inside an artifact (config.json, model.safetensors)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True, slots=True)
class EagleShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_theta: float


def read_checkpoint(path: str | Path) -> tuple[EagleShape, dict[str, torch.Tensor]]:
    """An EAGLE-1/2 head's shape and weights (names as published, without a `model.` prefix), or ValueError
    naming what is missing or not supported (EAGLE-3's layout, more than one layer, rope scaling)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"EAGLE checkpoint {path}: no config.json")
    cfg = json.loads(file.read_text(encoding="utf-8"))
    weights_file = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights_file is None:
        raise ValueError(f"EAGLE checkpoint {path}: no weights ({' or '.join(WEIGHT_FILES)})")
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw = load_file(str(weights_file))
    else:
        raw = torch.load(weights_file, map_location="cpu", weights_only=True)
    weights = {k.removeprefix("model."): v for k, v in raw.items()}
    eagle3 = sorted(k for k in weights if k.startswith("midlayer.") or k in ("d2t", "t2d"))
    if eagle3:
        raise ValueError(f"EAGLE checkpoint {path}: an EAGLE-3 head ({', '.join(eagle3[:3])}, ...: a fused "
                         "3-layer feature, its own vocabulary maps and LM head) is not supported yet; kiln loads "
                         "EAGLE-1/2 heads (fc.weight [hidden, 2*hidden], layers.0.*)")
    if int(cfg.get("num_hidden_layers", 1)) != 1 or any(k.startswith("layers.1.") for k in weights):
        raise ValueError(f"EAGLE checkpoint {path}: {cfg.get('num_hidden_layers')} decoder layers; kiln loads "
                         "one-layer EAGLE-1/2 heads")
    rope_cfg = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers 4 / 5 spelling
    if rope_cfg.get("rope_type", rope_cfg.get("type", "default")) != "default":
        raise ValueError(f"EAGLE checkpoint {path}: rope scaling {rope_cfg} is not supported (default rope only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"EAGLE checkpoint {path}: hidden_act {cfg['hidden_act']!r}; kiln loads silu heads")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    shape = EagleShape(hidden, heads, int(cfg.get("num_key_value_heads") or heads),
                       int(cfg.get("head_dim") or hidden // heads), int(cfg["intermediate_size"]),
                       float(cfg.get("rms_norm_eps", 1e-6)), float(cfg.get("rope_theta") or rope_cfg.get("rope_theta") or 10000.0))
    want = {"fc.weight": (hidden, 2 * hidden), "layers.0.post_attention_layernorm.weight": (hidden,),
            **{f"layers.0.{m}.weight": None for m in _LAYER}}
    missing = [k for k in want if k not in weights]
    if missing:
        raise ValueError(f"EAGLE checkpoint {path}: missing {', '.join(missing)} (an EAGLE-1/2 head has fc.weight "
                         "[hidden, 2*hidden] and one Llama decoder layer layers.0.*)")
    for k, s in want.items():
        if s is not None and tuple(weights[k].shape) != s:
            raise ValueError(f"EAGLE checkpoint {path}: {k} is {list(weights[k].shape)}, expected {list(s)} "
                             f"(hidden_size {hidden})")
    return shape, weights


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half) of x [n, heads, head_dim] at `positions` [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    freqs = positions.float()[:, None] * inv[None]
    cos, sin = (torch.cat([f, f], -1)[:, None].to(x.dtype) for f in (freqs.cos(), freqs.sin()))
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class EagleHead:
    """The head's math on one sequence's positions: `step(embeds, features, positions, past)` -> (features at the
    next positions, the new K/V rows to append to `past`)."""

    def __init__(self, shape: EagleShape, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = shape
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items() if not k.startswith(("lm_head",
                                                                                                       "embed"))}

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def step(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, n = self.shape, embeds.shape[0]
        h = self._linear(torch.cat([embeds, features], -1), "fc")
        x = h
        norm = self.w.get("layers.0.input_layernorm.weight")  # EAGLE-1/2: the first layer has none
        if norm is not None:
            x = rms_norm(x, norm, s.eps)
        q = rope(self._linear(x, "layers.0.self_attn.q_proj").view(n, s.heads, s.head_dim), positions, s.rope_theta)
        k = rope(self._linear(x, "layers.0.self_attn.k_proj").view(n, s.kv_heads, s.head_dim), positions,
                 s.rope_theta)
        v = self._linear(x, "layers.0.self_attn.v_proj").view(n, s.kv_heads, s.head_dim)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k]), torch.cat([past[1], v]))
        p = keys.shape[0] - n
        mask = torch.ones(n, p + n, dtype=torch.bool, device=x.device).tril(p)  # causal within the new rows
        rep = s.heads // s.kv_heads
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(rep, 1).transpose(0, 1),
                                              values.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
        h = h + self._linear(attn.transpose(0, 1).reshape(n, s.heads * s.head_dim), "layers.0.self_attn.o_proj")
        x = rms_norm(h, self.w["layers.0.post_attention_layernorm.weight"], s.eps)
        mlp = F.silu(self._linear(x, "layers.0.mlp.gate_proj")) * self._linear(x, "layers.0.mlp.up_proj")
        return h + self._linear(mlp, "layers.0.mlp.down_proj"), k, v


@dataclass(slots=True)
class _HeadKV:
    """One sequence's head KV: rows for positions `pos` (those of the target's computed tokens, then drafts')."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pos: torch.Tensor | None = None

    def keep_below(self, position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drops rows at `position` and after (drafts, rejected or not, and a preempted sequence's); the rest."""
        if self.pos is None:
            return None
        keep = self.pos < position
        self.k, self.v, self.pos = self.k[keep], self.v[keep], self.pos[keep]
        return (self.k, self.v) if self.pos.numel() else None

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        if self.pos is None or not self.pos.numel():
            self.k, self.v, self.pos = k, v, pos
        else:
            self.k, self.v, self.pos = torch.cat([self.k, k]), torch.cat([self.v, v]), torch.cat([self.pos, pos])


def target_tensor(model: Any, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The target model's weight `name` (a generated Model's attribute) as a plain tensor of `shape`."""
    t = getattr(model, name, None)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ArtifactError(f"speculative eagle: the target model has no {name} tensor {list(shape)} (an EAGLE head "
                            "shares the target's embedding, final norm and LM head: a Llama-family model)")
    return t


def target_lm_head(model: Any) -> Any:
    """features [n, hidden] -> float32 logits [n, vocab] by the target's own LM head kernel (its weight may be
    held in a kernel library's packed layout), `lm_head` or the tied embedding."""
    kernels = getattr(sys.modules[type(model).__module__], "K", None)
    weight = getattr(model, "lm_head", None)
    weight = model.embed if weight is None else weight
    if kernels is None or not hasattr(kernels, "logits"):
        raise ArtifactError("speculative eagle: the target's model.py has no LM head kernel (K.logits)")
    return lambda f: kernels.logits(f, weight, torch.arange(f.shape[0], device=f.device))


class EagleProposer(Proposer):
    """Runs the head over every token the target computed in the step (its KV must cover each computed
    position, drafting or not), rows past a rejected draft dropped; then chains it from each drafting sequence's
    last valid position `limit` times, greedily. Chained rows' KV is dropped at the next step, which rewrites
    those positions from the target's features. A prefix-cache hit leaves the head without KV for the cached
    positions: its drafts are then worse, never wrong (verification is exact)."""

    needs_hidden = True

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        path = Path(config.draft_model)
        if not path.is_absolute() and (artifact.path / path).is_dir():
            path = artifact.path / path
        try:
            shape, weights = read_checkpoint(path)
        except ValueError as e:
            raise ArtifactError(str(e)) from None
        model, mc = artifact.model, artifact.model_config
        kiln_file = path / "kiln.json"  # written by kiln compile; a raw checkpoint: its own eps (the target's)
        extra = json.loads(kiln_file.read_text(encoding="utf-8")) if kiln_file.is_file() else {}
        embed = self.embed = target_tensor(model, "embed", (mc.vocab_size, shape.hidden))
        self.lm_head = target_lm_head(model)
        self.norm = target_tensor(model, "norm", (shape.hidden,))
        self.norm_eps = float(extra.get("target_norm_eps") or shape.eps)
        self.head = EagleHead(shape, weights, embed.dtype, embed.device)
        self.kv: SeqStates[_HeadKV] = SeqStates(lambda seq: _HeadKV())

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states (before its final norm) as the head reads them."""
        return rms_norm(hidden, self.norm, self.norm_eps)

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        self.kv.prune()
        want = dict(zip(wanting, limits, strict=True))
        out: dict[int, list[int]] = {}
        device = self.embed.device
        feats = self.features(launched.draft_input.hidden)
        base = 0
        with torch.inference_mode():
            for i, (seq, n, start) in enumerate(zip(batch.seqs, batch.num_new_tokens, launched.starts,
                                                    strict=True)):
                rows = feats[base:base + seq.num_computed_tokens - start]  # valid rows: computed, token t+1 known
                base += n
                state = self.kv.get(seq)
                past = state.keep_below(start)
                if not rows.shape[0]:
                    continue
                nxt = torch.tensor(seq.token_ids[start + 1:seq.num_computed_tokens + 1], device=device)
                pos = torch.arange(start, seq.num_computed_tokens, device=device)
                f, k, v = self.head.step(self.embed[nxt], rows, pos, past)
                state.append(k, v, pos)
                if i not in want:
                    continue
                f, p, drafts = f[-1:], seq.num_computed_tokens, []
                while True:
                    drafts.append(int(self.lm_head(f).argmax(-1)))
                    if len(drafts) == want[i]:
                        break
                    pos = torch.tensor([p], device=device)
                    f, k, v = self.head.step(self.embed[torch.tensor(drafts[-1:], device=device)], f, pos,
                                             (state.k, state.v))
                    state.append(k, v, pos)
                    p += 1
                out[i] = drafts
        return [out.get(i, []) for i in wanting]
