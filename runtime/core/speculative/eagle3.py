"""EAGLE-3 draft heads for the `eagle` proposer (eagle.py): SafeAILab's / SpecForge's published layout
(`LlamaForCausalLMEagle3`, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

EAGLE-3 reads no single target feature: `fc` [hidden, 3*hidden] fuses the target's hidden states entering three
of its decoder layers (low, middle, high) into the first hidden state g_t. Its one decoder layer (`midlayer.*`)
attends over [input_layernorm(E(x_{t+1})); hidden_norm(g_t)] (q/k/v read 2*hidden), adds to g_t as the
residual, runs its MLP; the output o is what chains: draft 2..k feed o back as g. Its own final `norm` and LM
head score a draft vocabulary (`draft_vocab_size` ids, `lm_head` [draft_vocab, hidden]); a draft id d is target
id d + d2t[d]. The embedding is the target's.

Which layers: the config's `eagle_aux_hidden_state_layer_ids` at the top level, read as vLLM reads it (id j:
the hidden state entering target layer j, 0 the embedding's output), or under `eagle_config`, read as SGLang
reads it there (id j: layer j's output, so j + 1 here); otherwise (2, L // 2, L - 3) of an L-layer target, the
choice of both. kiln also takes id L, the last layer's output. The target's model.py returns them when its
forward is given `aux_layers` (the generated code keeps them only in that step's branch).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ArtifactError
from ...forward_batch import ForwardBatch
from ...worker.interface import DraftInput
from .eagle_head import EagleShape, PagedHeadLayer, head_shape, read_config, read_weights, target_tensor

_MID = "midlayer"
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
_BIASES = tuple(f"{_MID}.self_attn.{p}_proj.bias" for p in "qkvo") + ("fc.bias",)


@dataclass(frozen=True, slots=True)
class Eagle3Shape:
    """An EAGLE-3 head: its decoder layer (`layer`), the target vocabulary it drafts into (`vocab`) and its own
    (`draft_vocab`), how many target layers `fc` fuses (`num_aux`) and which (`layer_ids`, in this module's
    convention; None: the default of the target's depth), and whether its residual is the normed hidden state
    (`norm_before_residual`, as some converted heads are trained)."""

    layer: EagleShape
    vocab: int
    draft_vocab: int
    num_aux: int
    layer_ids: tuple[int, ...] | None
    norm_before_residual: bool

    def aux_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose entering hidden states `fc` reads, for a target of `num_layers` decoder layers,
        or ValueError."""
        ids = self.layer_ids
        if ids is None:
            ids = (2, num_layers // 2, num_layers - 3)  # vLLM's and SGLang's low / middle / high
        if len(ids) != self.num_aux:
            raise ValueError(f"{len(ids)} auxiliary layers {list(ids)} for an fc that fuses {self.num_aux} hidden "
                             f"states; give {self.num_aux} eagle_aux_hidden_state_layer_ids")
        bad = [i for i in ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"auxiliary layers {list(ids)}: {bad} outside the target's 0..{num_layers} (the hidden "
                             f"state entering each of its {num_layers} decoder layers, {num_layers}: the last "
                             "one's output); give eagle_aux_hidden_state_layer_ids")
        return tuple(ids)


def _layer_ids(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """The config's layer ids in this module's convention (see the module docstring), or None for the default."""
    nested = cfg.get("eagle_config") or {}
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"])
    if nested.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) + 1 for i in nested["eagle_aux_hidden_state_layer_ids"])
    return None


def read_eagle3_checkpoint(path: str | Path) -> tuple[Eagle3Shape, dict[str, torch.Tensor]]:
    """An EAGLE-3 head's shape and weights (names as published, without a `model.` prefix; `embed_tokens` left
    out: the head reads the target's), or ValueError naming what is missing, misshapen or not supported."""
    path = Path(path)
    cfg = read_config(path)
    layer = head_shape(path)
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"EAGLE-3 checkpoint {path}: use_aux_hidden_state is false (a head over the target's "
                         "last hidden state only); kiln loads EAGLE-3 heads that fuse auxiliary hidden states")
    hidden = layer.hidden
    if int(cfg.get("target_hidden_size") or hidden) != hidden:
        raise ValueError(f"EAGLE-3 checkpoint {path}: target_hidden_size {cfg['target_hidden_size']} differs from "
                         f"its hidden_size {hidden}; kiln loads heads as wide as their target")
    if not cfg.get("vocab_size"):
        raise ValueError(f"EAGLE-3 checkpoint {path}: no vocab_size in config.json (the target's vocabulary, which d2t "
                         "maps draft ids into)")
    vocab = int(cfg["vocab_size"])
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    weights = {k: v for k, v in read_weights(path).items()
               if not k.startswith("embed_tokens.") and not k.endswith("rotary_emb.inv_freq")}
    fc = weights.get("fc.weight")
    num_aux = fc.shape[1] // hidden if fc is not None and fc.dim() == 2 and fc.shape[1] % hidden == 0 else 3
    q, kv = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
    want = {"fc.weight": (hidden, num_aux * hidden),
            **{f"{_MID}.{n}.weight": (hidden,) for n in _NORMS},
            f"{_MID}.self_attn.q_proj.weight": (q, 2 * hidden), f"{_MID}.self_attn.k_proj.weight": (kv, 2 * hidden),
            f"{_MID}.self_attn.v_proj.weight": (kv, 2 * hidden), f"{_MID}.self_attn.o_proj.weight": (hidden, q),
            f"{_MID}.mlp.gate_proj.weight": (layer.ffn, hidden), f"{_MID}.mlp.up_proj.weight": (layer.ffn, hidden),
            f"{_MID}.mlp.down_proj.weight": (hidden, layer.ffn),
            "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden)}
    if draft_vocab != vocab:
        want["d2t"] = (draft_vocab,)
    missing = [k for k in want if k not in weights]
    if missing:
        raise ValueError(f"EAGLE-3 checkpoint {path}: missing {', '.join(missing)} (an EAGLE-3 head has fc.weight "
                         "[hidden, 3*hidden], one decoder layer midlayer.* whose q/k/v read 2*hidden, norm.weight, "
                         "lm_head.weight [draft_vocab_size, hidden] and d2t)")
    optional = {"d2t": (draft_vocab,), "t2d": (vocab,), **{b: (want[b.replace(".bias", ".weight")][0],)
                                                          for b in _BIASES}}
    unknown = sorted(set(weights) - set(want) - set(optional))
    if unknown:
        raise ValueError(f"EAGLE-3 checkpoint {path}: tensors {', '.join(unknown[:4])} are not those of an EAGLE-3 "
                         "head kiln runs (fc, midlayer.*, norm, lm_head, d2t, t2d)")
    for k, v in weights.items():
        s = want.get(k, optional.get(k))
        if tuple(v.shape) != s:
            raise ValueError(f"EAGLE-3 checkpoint {path}: {k} is {list(v.shape)}, expected {list(s)} (hidden_size "
                             f"{hidden}, vocab_size {vocab}, draft_vocab_size {draft_vocab})")
    if "d2t" in weights:
        d2t = weights["d2t"]
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise ValueError(f"EAGLE-3 checkpoint {path}: d2t is {d2t.dtype}; it holds integer offsets")
        target_ids = torch.arange(draft_vocab) + d2t.long()
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise ValueError(f"EAGLE-3 checkpoint {path}: d2t maps draft ids outside the vocabulary 0..{vocab - 1}")
    shape = Eagle3Shape(layer, vocab, draft_vocab, num_aux, _layer_ids(cfg),
                        bool(cfg.get("norm_before_residual", False)))
    return shape, weights


def check_target(shape: Eagle3Shape, path: Path, hidden: int, vocab: int, num_layers: int) -> tuple[int, ...]:
    """The head against its target (hidden size, vocabulary, depth): the target layers it reads, or ValueError."""
    if shape.layer.hidden != hidden:
        raise ValueError(f"EAGLE-3 checkpoint {path}: hidden_size {shape.layer.hidden}, the target's is {hidden}")
    if shape.vocab != vocab:
        raise ValueError(f"EAGLE-3 checkpoint {path}: vocab_size {shape.vocab}, the target's is {vocab} (its d2t "
                         "maps draft ids into the target's vocabulary)")
    try:
        return shape.aux_layers(num_layers)
    except ValueError as e:
        raise ValueError(f"EAGLE-3 checkpoint {path}: {e}") from None


class Eagle3Head(PagedHeadLayer):
    """The EAGLE-3 head's math (module docstring) by the target's kernel library, over the proposer's flat batch
    of several sequences' rows. `start` fuses the target's auxiliary hidden states of the step's rows; `forward`
    runs the midlayer to the hidden state that chains; `logits` scores the draft vocabulary; `draft` maps its
    greedy ids to the target's."""

    prefix = _MID

    def __init__(self, shape: Eagle3Shape, weights: dict[str, torch.Tensor], aux_layers: tuple[int, ...],
                 kernels: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        self.draft_vocab = shape.draft_vocab
        self.aux_layers = aux_layers
        self.norm_before_residual = shape.norm_before_residual
        d2t = weights.get("d2t")
        # draft id -> target id, one gather a draft (identity when the head drafts the whole vocabulary)
        self.target_ids = None if d2t is None else (torch.arange(shape.draft_vocab) + d2t.long()).to(device)
        layer = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
        super().__init__(shape.layer, layer, kernels, dtype, device, max_position, packed=("fc", "lm_head"))

    def start(self, draft: DraftInput, rows: torch.Tensor) -> torch.Tensor:
        """g_t of the step's hidden rows `rows`: fc over the target's auxiliary hidden states there."""
        return self._linear(torch.cat([a[rows] for a in draft.aux], -1), "fc")

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        K, s, w = self.K, self.shape, self.w
        normed = K.rms_norm(hidden, w[f"{_MID}.hidden_norm.weight"], s.eps)
        x = K.concat(K.rms_norm(embeds, w[f"{_MID}.input_layernorm.weight"], s.eps), normed)
        return self._layer(x, normed if self.norm_before_residual else hidden, batch, kv_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, draft_vocab] of the head's hidden states: its own final norm and LM head."""
        return self._linear(self.K.rms_norm(hidden, self.w["norm.weight"], self.shape.eps), "lm_head").float()

    def draft(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target token ids of the head's hidden states."""
        ids = self.logits(hidden).argmax(-1)
        return ids if self.target_ids is None else self.target_ids[ids]


def load_eagle3_head(path: Path, artifact: Any, kernels: Any) -> Eagle3Head:
    """The EAGLE-3 head at `path` for the loaded target `artifact` (ValueError: the checkpoint or its fit to the
    target; ArtifactError: a target that cannot feed it)."""
    shape, weights = read_eagle3_checkpoint(path)
    model = artifact.model
    num_layers = getattr(sys.modules[type(model).__module__], "NUM_LAYERS", None)
    if num_layers is None:
        raise ArtifactError(f"speculative eagle: {artifact.path}'s model.py cannot return the hidden states of chosen "
                            "layers, which an EAGLE-3 head reads (no NUM_LAYERS: compiled by an older kiln); "
                            "recompile the artifact")
    if artifact.world_size > 1:
        raise ArtifactError("speculative eagle: an EAGLE-3 head on a parallel artifact is not implemented yet (its "
                            "auxiliary hidden states are not gathered from the ranks); EAGLE-1/2 heads, ngram and "
                            "draft models are")
    mc, embed = artifact.model_config, getattr(model, "embed", None)
    if embed is None:
        raise ArtifactError("speculative eagle: the target model has no embedding `embed`, which an EAGLE-3 head "
                            "shares")
    aux_layers = check_target(shape, path, int(embed.shape[-1]), mc.vocab_size, int(num_layers))
    embed = target_tensor(model, "embed", (mc.vocab_size, shape.layer.hidden), packed=True)
    return Eagle3Head(shape, weights, aux_layers, kernels, embed.dtype, artifact.device, mc.max_model_len)
