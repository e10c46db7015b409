"""A tiny DeepSeek-V3 checkpoint with a multi-token-prediction (MTP) layer, and an independent torch reference of
the MTP head built from HF's DeepseekV3 modules (transformers' DeepseekV3ForCausalLM ignores the MTP weights).

MTP module k = 1 lives at checkpoint layer L = num_hidden_layers: `enorm`, `hnorm` (RMSNorm), `eh_proj`
[hidden, 2 * hidden], a full decoder layer (MoE here, as in V3), `shared_head.norm`, `shared_head.head` and an
`embed_tokens` copy. For position t: h' = eh_proj([enorm(embed(token t+1)) | hnorm(h_t)]) -> decoder layer
(causal over positions <= t) -> shared_head.norm -> shared_head.head = logits of token t+2, where h_t is the
main model's last hidden state before its final norm.
"""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import load_file, save_file


def add_mtp_layer(ckpt: pathlib.Path, *, seed: int = 7, copies: bool = True,
                  repeat_head: bool = False) -> dict[str, torch.Tensor]:
    """Adds random MTP weights (layer `num_hidden_layers`) to a saved HF DeepSeek-V3 checkpoint in place and sets
    num_nextn_predict_layers = 1; returns the MTP tensors by checkpoint name. `copies`: also store the embedding
    and LM head copies DeepSeek's checkpoints carry (equal to the main ones).

    `repeat_head`: weights that make the head a drafter with a known behaviour: eh_proj passes hnorm(h_t) through,
    the decoder layer adds nothing (zero output projections), and the head is the main model's final norm + LM
    head, so the draft for token t+2 is the main model's choice for token t+1 — right whenever the model repeats
    a token (tiny random models often do), so a test sees drafts accepted and rejected."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = AutoConfig.from_pretrained(ckpt)
    L = config.num_hidden_layers
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, layer_idx=L).float()
    prefix = f"model.layers.{L}."
    mtp = {}
    for name, t in layer.state_dict().items():
        t = t.clone()
        if name.endswith("norm.weight"):
            t = 1.0 + 0.5 * torch.randn_like(t)
        elif t.dim() >= 2:
            t = torch.randn_like(t) * config.initializer_range * 4
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn_like(t) * 0.02
        mtp[prefix + name] = t.contiguous()
    # checkpoints store one tensor per expert (HF fuses them on load): [gate | up] rows, down
    ffn = config.moe_intermediate_size
    gate_up, down = mtp.pop(prefix + "mlp.experts.gate_up_proj"), mtp.pop(prefix + "mlp.experts.down_proj")
    for e in range(gate_up.shape[0]):
        mtp[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :ffn].contiguous()
        mtp[f"{prefix}mlp.experts.{e}.up_proj.weight"] = gate_up[e, ffn:].contiguous()
        mtp[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down[e].contiguous()
    h = config.hidden_size
    mtp[prefix + "enorm.weight"] = 1.0 + 0.5 * torch.randn(h)
    mtp[prefix + "hnorm.weight"] = 1.0 + 0.5 * torch.randn(h)
    mtp[prefix + "shared_head.norm.weight"] = 1.0 + 0.5 * torch.randn(h)
    mtp[prefix + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.1
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    if repeat_head:
        mtp[prefix + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
        mtp[prefix + "hnorm.weight"] = torch.ones(h)
        mtp[prefix + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                mtp[name] = torch.zeros_like(mtp[name])
    if copies:
        mtp[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        mtp[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return mtp


class MTPReference(torch.nn.Module):
    """DeepSeek-V3's MTP module 1 from HF building blocks, fp32, with the main model for h_t."""

    def __init__(self, ckpt: pathlib.Path, main: torch.nn.Module):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        config = main.config
        L = config.num_hidden_layers
        self.main = main
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.head_norm = (DeepseekV3RMSNorm(h, eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=L)
        prefix = f"model.layers.{L}."
        w = {k[len(prefix):]: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if k.startswith(prefix)}
        state = {k: v for k, v in w.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_attention_"))
                 and ".experts." not in k}
        E = config.n_routed_experts
        expert = lambda e, p: w[f"mlp.experts.{e}.{p}.weight"]  # noqa: E731
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")])
                                                         for e in range(E)])
        state["mlp.experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in range(E)])
        self.layer.load_state_dict(state)
        self.enorm.weight.data.copy_(w["enorm.weight"])
        self.hnorm.weight.data.copy_(w["hnorm.weight"])
        self.head_norm.weight.data.copy_(w["shared_head.norm.weight"])
        self.eh_proj.weight.data.copy_(w["eh_proj.weight"])
        # the layer's own copies where the checkpoint has them, else the main model's
        self.embed = w.get("embed_tokens.weight", main.model.embed_tokens.weight.data)
        self.head = w.get("shared_head.head.weight", main.lm_head.weight.data)
        self.float().eval()

    @torch.no_grad()
    def main_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The main model's last hidden states before the final norm, [T, hidden]."""
        seen = {}
        hook = self.main.model.norm.register_forward_hook(lambda mod, args, out: seen.setdefault("h", args[0]))
        try:
            self.main(torch.tensor([tokens]))
        finally:
            hook.remove()
        return seen["h"][0]

    @torch.no_grad()
    def forward(self, tokens: list[int], next_tokens: list[int]) -> torch.Tensor:
        """MTP logits [T, vocab]: row t from h_t (main model over `tokens`) and the embedding of next_tokens[t]."""
        hidden = self.main_hidden(tokens)
        T = len(tokens)
        emb = torch.nn.functional.embedding(torch.tensor(next_tokens), self.embed)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))[None]
        positions = torch.arange(T)[None]
        rope = self.main.model.rotary_emb(x, positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return self.head_norm(out[0]) @ self.head.T
