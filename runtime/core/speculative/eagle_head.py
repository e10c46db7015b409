"""An EAGLE draft head's checkpoint and layers, shared by the EAGLE-1/2 proposer (eagle.py) and EAGLE-3's head
(eagle3.py): the checkpoint's config, shapes and weights (SafeAILab's layout), the paged decoder layer a head runs
on the target's own kernels, and the target tensors (embedding, LM head) a head shares."""
from __future__ import annotations

import functools
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ArtifactError
from ...forward_batch import ForwardBatch
from ...worker.interface import DraftInput
from ..batch import cdiv

EAGLE_DIR = "eagle"  # the head's checkpoint inside an artifact (config.json, model.safetensors)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# pytorch_model.bin is a pickle: read only with torch.load(weights_only=True), which before torch 2.6 could still
# run code from a crafted file (CVE-2025-32434); the package floor is lower, so older torches refuse the file
PICKLE_SAFE_TORCH = (2, 6)
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


def read_config(path: str | Path) -> dict[str, Any]:
    """An EAGLE checkpoint's config.json, or ValueError."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"EAGLE checkpoint {path}: no config.json")
    return json.loads(file.read_text(encoding="utf-8"))


def head_shape(path: str | Path) -> EagleShape:
    """An EAGLE head's decoder-layer shape from its config.json, or ValueError naming what is not supported
    (more than one layer, rope scaling, an activation other than silu)."""
    path = Path(path)
    cfg = read_config(path)
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE checkpoint {path}: {cfg.get('num_hidden_layers')} decoder layers; kiln loads "
                         "one-layer EAGLE heads")
    rope_cfg = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers 4 / 5 spelling
    if rope_cfg.get("rope_type", rope_cfg.get("type", "default")) != "default":
        raise ValueError(f"EAGLE checkpoint {path}: rope scaling {rope_cfg} is not supported (default rope only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"EAGLE checkpoint {path}: hidden_act {cfg['hidden_act']!r}; kiln loads silu heads")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return EagleShape(hidden, heads, int(cfg.get("num_key_value_heads") or heads),
                      int(cfg.get("head_dim") or hidden // heads), int(cfg["intermediate_size"]),
                      float(cfg.get("rms_norm_eps", 1e-6)),
                      float(cfg.get("rope_theta") or rope_cfg.get("rope_theta") or 10000.0))


def pickle_safe_torch(version: str) -> bool:
    """Whether torch `version`'s torch.load(weights_only=True) is safe on an untrusted file (>= 2.6)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= PICKLE_SAFE_TORCH


def weights_file(path: Path) -> Path:
    """The checkpoint's weights file (ValueError: none, or a pickle this torch cannot read safely)."""
    file = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if file is None:
        raise ValueError(f"EAGLE checkpoint {path}: no weights ({' or '.join(WEIGHT_FILES)})")
    if file.suffix == ".bin" and not pickle_safe_torch(torch.__version__):
        raise ValueError(f"EAGLE checkpoint {path}: {file.name} is a pickle, and torch {torch.__version__}'s "
                         "torch.load(weights_only=True) can run code from a crafted one (CVE-2025-32434, fixed in "
                         "torch 2.6); upgrade torch to >= 2.6 or convert the head to model.safetensors")
    return file


def weight_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape (names as published, without a `model.` prefix), from the file's header."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    else:
        shapes = {k: list(v.shape) for k, v in torch.load(file, map_location="cpu", weights_only=True,
                                                          mmap=True).items()}
    return {k.removeprefix("model."): shape for k, shape in shapes.items()}


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """An EAGLE checkpoint's tensors (model.safetensors or pytorch_model.bin), names without a `model.` prefix."""
    file = weights_file(Path(path))
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw = load_file(str(file))
    else:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    return {k.removeprefix("model."): v for k, v in raw.items()}


def is_eagle3(path: str | Path) -> bool:
    """Whether the checkpoint is an EAGLE-3 head (eagle3.py): its architecture says so, or it has EAGLE-3's
    tensors (the decoder layer as `midlayer.*`, the draft vocabulary's `d2t` / `t2d`). Either reader then says
    what is missing."""
    path = Path(path)
    archs = " ".join(read_config(path).get("architectures") or []).lower()
    return "eagle3" in archs or any(k.startswith("midlayer.") or k in ("d2t", "t2d") for k in weight_shapes(path))


def head_numel(path: Path, own: tuple[str, ...] = ("lm_head", "embed")) -> int:
    """Elements of the head's own weights: all but those it reads from the target (names starting with `own`'s)."""
    return sum(math.prod(shape) for k, shape in weight_shapes(path).items() if not k.startswith(own))


def read_checkpoint(path: str | Path) -> tuple[EagleShape, dict[str, torch.Tensor]]:
    """An EAGLE-1/2 head's shape and weights (names as published, without a `model.` prefix), or ValueError
    naming what is missing or not supported (more than one layer, rope scaling)."""
    path = Path(path)
    shape = head_shape(path)
    weights = read_weights(path)
    if any(k.startswith("layers.1.") for k in weights):
        raise ValueError(f"EAGLE checkpoint {path}: more than one decoder layer; kiln loads one-layer EAGLE-1/2 "
                         "heads")
    hidden = shape.hidden
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


_FUSED = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}


def _fuse(w: dict[str, torch.Tensor], names: list[str], fused: str) -> None:
    """Replaces the linears `names` of `w` by one whose output is theirs side by side (a missing bias: zeros)."""
    weights = [w.pop(f"{n}.weight") for n in names]
    biases = [w.pop(f"{n}.bias", None) for n in names]
    w[f"{fused}.weight"] = torch.cat(weights)
    if any(b is not None for b in biases):
        w[f"{fused}.bias"] = torch.cat([b if b is not None else weights[i].new_zeros(weights[i].shape[0])
                                        for i, b in enumerate(biases)])


class PagedHeadLayer:
    """One Llama decoder layer of a draft head (its weights under `prefix`), run by the target's own kernel
    library `kernels` (the `K` of its model.py: the rms_norm, rope, paged attention and GEMMs the target runs)
    over a flat, token-major batch of several sequences' rows, its K/V in a paged pool of its own.

    q/k/v are fused into one GEMM and gate/up into another, as the target's fuse_qkv / fuse_gate_up make them;
    a library whose GEMM reads weights in its own layout (TVM's) gets `packed` and the layer's GEMM weights
    packed. Subclasses say what enters the attention (`forward`) and what a hidden state drafts (`draft`)."""

    prefix = "layers.0"

    def __init__(self, shape: EagleShape, weights: dict[str, torch.Tensor], kernels: Any, dtype: torch.dtype,
                 device: torch.device, max_position: int, packed: tuple[str, ...] = ()) -> None:
        self.shape = shape
        self.K = kernels
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        p = self.prefix
        for module, (fused, parts) in _FUSED.items():
            _fuse(self.w, [f"{p}.{module}.{part}" for part in parts], f"{p}.{module}.{fused}")
        if hasattr(kernels, "pack_weights"):
            kernels.pack_weights(self.w, {f"{n}.weight" for n in (*packed, f"{p}.self_attn.qkv_proj",
                                                                   f"{p}.self_attn.o_proj", f"{p}.mlp.gate_up_proj",
                                                                   f"{p}.mlp.down_proj")})
        self.qkv_split = [shape.heads * shape.head_dim] + [shape.kv_heads * shape.head_dim] * 2
        self.rope = kernels.rope_cache(shape.head_dim, max_position, shape.rope_theta).to(device)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.K.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _layer(self, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch,
               kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer from its attention input `x` on: q/k/v of x, paged attention (each row's K/V written at
        `batch.slot_mapping`, then its sequence's rows read through `batch.block_tables` and `batch.seq_lens`,
        q and k roped at `batch.positions`), its output added to `residual`, then the MLP with its residual."""
        s, K, p, n = self.shape, self.K, self.prefix, x.shape[0]
        q, k, v = self._linear(x, f"{p}.self_attn.qkv_proj").split(self.qkv_split, -1)
        a = K.paged_attention(q.reshape(n, s.heads, s.head_dim), k.reshape(n, s.kv_heads, s.head_dim),
                              v.reshape(n, s.kv_heads, s.head_dim), kv_cache, batch, s.head_dim ** -0.5,
                              rope_cache=self.rope)
        h = residual + self._linear(a, f"{p}.self_attn.o_proj")
        x = K.rms_norm(h, self.w[f"{p}.post_attention_layernorm.weight"], s.eps)
        return h + self._linear(K.silu_mul(self._linear(x, f"{p}.mlp.gate_up_proj")), f"{p}.mlp.down_proj")

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """The embeddings of tokens t+1 and the hidden states at t [T, hidden] of the rows of `batch` -> the
        head's hidden states at t+1 [T, hidden] (what `draft` reads, and the next chained draft's `hidden`)."""
        raise NotImplementedError

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past: None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` over one sequence's rows at consecutive `positions` with no rows before them, on a scratch
        pool: (hidden states, the rows' K, their V). A reference check's entry point; the proposer runs `forward`."""
        assert past is None, "a head's step runs one sequence from no past rows"
        s, n, bs = self.shape, embeds.shape[0], 16
        dev = embeds.device
        kv = torch.zeros(cdiv(n, bs), 2, bs, s.kv_heads, s.head_dim, dtype=embeds.dtype, device=dev)
        i32 = functools.partial(torch.tensor, dtype=torch.int32, device=dev)
        batch = ForwardBatch(input_ids=i32([0] * n), positions=positions.to(device=dev, dtype=torch.int32),
                             query_start_loc=i32([0, n]), seq_lens=i32([n]),
                             block_tables=i32([list(range(kv.shape[0]))]),
                             slot_mapping=torch.arange(n, device=dev), logits_indices=i32([]))
        out = self.forward(embeds, hidden, batch, kv)
        return out, kv[:, 0].flatten(0, 1)[:n], kv[:, 1].flatten(0, 1)[:n]


class EagleHead(PagedHeadLayer):
    """EAGLE-1/2: f(t+1) = Layer(fc([E(x_{t+1}); F_t])), F_t the target's last hidden state after its final norm
    (`start`), a chained draft's F its own output f; drafts are the target LM head's greedy tokens of f. The
    first layer has no input norm in SafeAILab's layout (used where a checkpoint has one)."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, shape: EagleShape, weights: dict[str, torch.Tensor], model: Any, kernels: Any,
                 max_position: int, norm_eps: float) -> None:
        self.target_norm = target_tensor(model, "norm", (shape.hidden,))
        self.norm_eps = norm_eps
        self.lm_head = target_lm_head(model)
        own = {k: v for k, v in weights.items() if not k.startswith(("lm_head", "embed"))}
        super().__init__(shape, own, kernels, self.target_norm.dtype, self.target_norm.device, max_position,
                         packed=("fc",))

    def start(self, draft: DraftInput, rows: torch.Tensor) -> torch.Tensor:
        """F_t of the step's hidden rows `rows`: the target's hidden states (before its final norm) normed."""
        return self.K.rms_norm(draft.hidden[rows], self.target_norm, self.norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        h = self._linear(self.K.concat(embeds, hidden), "fc")
        norm = self.w.get("layers.0.input_layernorm.weight")  # EAGLE-1/2: the first layer has none
        return self._layer(h if norm is None else self.K.rms_norm(h, norm, self.shape.eps), h, batch, kv_cache)

    def draft(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target token ids of the head's hidden states, by the target's LM head."""
        return self.lm_head(hidden).argmax(-1)


def target_tensor(model: Any, name: str, shape: tuple[int, ...], packed: bool = False) -> torch.Tensor:
    """The target model's weight `name` (a generated Model's attribute) of `shape`: a plain tensor, or with
    `packed` also one its kernel library holds in a layout of its own (read only by its kernels)."""
    t = getattr(model, name, None)
    if (not isinstance(t, torch.Tensor) and not (packed and hasattr(t, "dtype"))
            or tuple(getattr(t, "shape", ())) != shape):
        raise ArtifactError(f"speculative eagle: the target model has no {name} tensor {list(shape)} (an EAGLE head "
                            "shares the target's embedding, final norm and LM head: a Llama-family model)")
    return t


# what the head runs of the target's kernel library
_KERNELS = ("logits", "embedding", "linear", "concat", "rms_norm", "rope_cache", "paged_attention", "silu_mul")


def target_kernels(model: Any) -> Any:
    """The target's kernel library (the `K` its generated model.py calls), which the head runs on too."""
    kernels = getattr(sys.modules[type(model).__module__], "K", None)
    missing = [k for k in _KERNELS if kernels is not None and not hasattr(kernels, k)]
    if kernels is None or missing:
        raise ArtifactError(f"speculative eagle: the target's model.py has no kernel library with "
                            f"{', '.join(missing or _KERNELS)} (K.*), which the EAGLE head runs on")
    return kernels


def target_lm_head(model: Any) -> Any:
    """features [n, hidden] -> float32 logits [n, vocab] by the target's own LM head kernel (its weight may be
    held in a kernel library's packed layout), `lm_head` or the tied embedding."""
    kernels = target_kernels(model)
    weight = getattr(model, "lm_head", None)
    weight = model.embed if weight is None else weight
    return lambda f: kernels.logits(f, weight, torch.arange(f.shape[0], device=f.device))
