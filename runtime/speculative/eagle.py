"""The `eagle` proposer: an EAGLE-1/2 draft head (SafeAILab's published layout) drafting k tokens a step.

The head is one Llama decoder layer after a projection `fc` of [embedding(token t+1); target feature at t]
(the target's last hidden state after its final norm) to a feature at t+1; the target's LM head turns a feature
into draft logits. It shares the target's embedding and LM head, and keeps the KV of its one layer itself, paged
(its own block pool, a block table per sequence). Drafts 2..k chain the head on its own output feature and the
previous draft. The head runs by the target's kernel library (its model.py's `K`), batched over every sequence of
a step: one varlen forward over the step's tokens, then one decode forward per chained draft.

`read_checkpoint` checks a checkpoint directory (config.json and fc.weight / layers.0.* in model.safetensors or
pytorch_model.bin) and is what `kiln compile` runs for `speculative { method = eagle; draft = "hf:DIR" }` before
storing the head in the artifact's eagle/ (EAGLE_DIR).
"""
from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import SpeculativeConfig
from ..errors import ArtifactError
from ..forward_batch import ForwardBatch
from ..kv_cache import BlockManager, cdiv
from ..model_runner import host_to_device
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from . import Launched, PoolShare, Proposer, SeqStates, draft_path, shadow_sequence

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


def head_shape(path: str | Path) -> EagleShape:
    """An EAGLE-1/2 head's shape from its config.json, or ValueError naming what is not supported (more than one
    layer, rope scaling, an activation other than silu)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"EAGLE checkpoint {path}: no config.json")
    cfg = json.loads(file.read_text(encoding="utf-8"))
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE checkpoint {path}: {cfg.get('num_hidden_layers')} decoder layers; kiln loads "
                         "one-layer EAGLE-1/2 heads")
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


def _head_numel(path: Path) -> int:
    """Elements of the head's own weights (not its copy of the embedding or LM head), from the file's header."""
    file = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if file is None:
        raise ValueError(f"EAGLE checkpoint {path}: no weights")
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    else:
        shapes = {k: list(v.shape) for k, v in torch.load(file, map_location="cpu", weights_only=True,
                                                          mmap=True).items()}
    own = [shape for k, shape in shapes.items() if not k.removeprefix("model.").startswith(("lm_head", "embed"))]
    return sum(math.prod(shape) for shape in own)


def read_checkpoint(path: str | Path) -> tuple[EagleShape, dict[str, torch.Tensor]]:
    """An EAGLE-1/2 head's shape and weights (names as published, without a `model.` prefix), or ValueError
    naming what is missing or not supported (EAGLE-3's layout, more than one layer, rope scaling)."""
    path = Path(path)
    shape = head_shape(path)
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


_QKV = "layers.0.self_attn.qkv_proj"  # q/k/v fused into one GEMM, as the target's fuse_qkv makes it
_GATE_UP = "layers.0.mlp.gate_up_proj"  # gate/up likewise (fuse_gate_up), read by the kernels' silu_mul


def _fuse(w: dict[str, torch.Tensor], names: list[str], fused: str) -> None:
    """Replaces the linears `names` of `w` by one whose output is theirs side by side (a missing bias: zeros)."""
    weights = [w.pop(f"{n}.weight") for n in names]
    biases = [w.pop(f"{n}.bias", None) for n in names]
    w[f"{fused}.weight"] = torch.cat(weights)
    if any(b is not None for b in biases):
        w[f"{fused}.bias"] = torch.cat([b if b is not None else weights[i].new_zeros(weights[i].shape[0])
                                        for i, b in enumerate(biases)])


class EagleHead:
    """The head's math over a flat, token-major batch of several sequences' rows, by the target's own kernel
    library `kernels` (the `K` of its model.py: the rms_norm, rope, paged attention and GEMMs the target runs).

    `forward(embeds, features, batch, kv_cache)`: the embeddings of tokens t+1 and the features at t [T, hidden]
    of the rows of `batch` (a ForwardBatch of the head's one paged KV layer `kv_cache`: each row's K/V is written
    at `batch.slot_mapping`, then it attends over its sequence's rows through `batch.block_tables` and
    `batch.seq_lens`; `batch.positions` are the rows' positions in their sequences, for the rotary embedding)
    -> the features at t+1 [T, hidden]."""

    def __init__(self, shape: EagleShape, weights: dict[str, torch.Tensor], kernels: Any, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> None:
        self.shape = shape
        self.K = kernels
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items() if not k.startswith(("lm_head",
                                                                                                       "embed"))}
        _fuse(self.w, [f"layers.0.self_attn.{p}_proj" for p in "qkv"], _QKV)
        _fuse(self.w, ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"], _GATE_UP)
        if hasattr(kernels, "pack_weights"):  # a library whose GEMM reads weights in its own layout (TVM's)
            kernels.pack_weights(self.w, {f"{n}.weight" for n in ("fc", _QKV, "layers.0.self_attn.o_proj", _GATE_UP,
                                                                   "layers.0.mlp.down_proj")})
        self.qkv_split = [shape.heads * shape.head_dim] + [shape.kv_heads * shape.head_dim] * 2
        self.rope = kernels.rope_cache(shape.head_dim, max_position, shape.rope_theta).to(device)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.K.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        s, K, n = self.shape, self.K, embeds.shape[0]
        h = self._linear(K.concat(embeds, features), "fc")
        x = h
        norm = self.w.get("layers.0.input_layernorm.weight")  # EAGLE-1/2: the first layer has none
        if norm is not None:
            x = K.rms_norm(x, norm, s.eps)
        q, k, v = self._linear(x, _QKV).split(self.qkv_split, -1)
        a = K.paged_attention(q.reshape(n, s.heads, s.head_dim), k.reshape(n, s.kv_heads, s.head_dim),
                              v.reshape(n, s.kv_heads, s.head_dim), kv_cache, batch, s.head_dim ** -0.5,
                              rope_cache=self.rope)  # q and k roped at batch.positions, as K.rope does
        h = h + self._linear(a, "layers.0.self_attn.o_proj")
        x = K.rms_norm(h, self.w["layers.0.post_attention_layernorm.weight"], s.eps)
        return h + self._linear(K.silu_mul(self._linear(x, _GATE_UP)), "layers.0.mlp.down_proj")

    def step(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             past: None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` over one sequence's rows at consecutive `positions` with no rows before them, on a scratch
        pool: (features, the rows' K, their V). A reference check's entry point; the proposer runs `forward`."""
        assert past is None, "EagleHead.step runs one sequence from no past rows"
        s, n, bs = self.shape, embeds.shape[0], 16
        dev = embeds.device
        kv = torch.zeros(cdiv(n, bs), 2, bs, s.kv_heads, s.head_dim, dtype=embeds.dtype, device=dev)
        i32 = functools.partial(torch.tensor, dtype=torch.int32, device=dev)
        batch = ForwardBatch(input_ids=i32([0] * n), positions=positions.to(device=dev, dtype=torch.int32),
                             query_start_loc=i32([0, n]), seq_lens=i32([n]),
                             block_tables=i32([list(range(kv.shape[0]))]),
                             slot_mapping=torch.arange(n, device=dev), logits_indices=i32([]))
        out = self.forward(embeds, features, batch, kv)
        return out, kv[:, 0].flatten(0, 1)[:n], kv[:, 1].flatten(0, 1)[:n]


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


@dataclass(slots=True)
class _HeadKV:
    """One sequence's rows in the head's paged pool: the K/V of its positions `first`, `first` + 1, ... (those
    of the target's computed tokens, then drafts'), in the blocks of `shadow.block_table` (the head's
    BlockManager), `shadow.num_computed_tokens` of them being the rows kept across steps."""

    shadow: Sequence
    first: int = 0

    def keep_below(self, position: int) -> None:
        """Drops rows at `position` and after (drafts, rejected or not, and a preempted sequence's); rows would
        start at `position` when none below it are held (a prefix-cache hit, or a recompute from the start)."""
        held = self.shadow.num_computed_tokens
        if self.first <= position <= self.first + held:
            self.shadow.num_computed_tokens = position - self.first
        else:
            self.first, self.shadow.num_computed_tokens = position, 0


class EagleProposer(Proposer):
    """Runs the head over every token the target computed in the step (its KV must cover each computed
    position, drafting or not), rows past a rejected draft dropped: one varlen forward over every sequence of
    the step; then chains it from each drafting sequence's last valid position `limit` times, greedily: one
    batched decode forward per draft over the sequences still drafting. The head's KV is one paged layer of
    its own (a BlockManager over as many token slots as the target's pool plus k + a block per sequence it may
    run), block tables per sequence. Chained rows' KV is dropped at the next step, which rewrites those
    positions from the target's features. A prefix-cache hit leaves the head without KV for the cached
    positions: its drafts are then worse, never wrong (verification is exact); so does a full head pool (the
    sequence's rows restart at the next step)."""

    needs_hidden = True

    @classmethod
    def pool_share(cls, config: SpeculativeConfig, artifact: Any) -> PoolShare:
        """One KV layer per target token slot, plus k + a block per sequence, and the head's weights (all but the
        embedding and LM head, which it reads from the target), in the target's dtype: from its config and its
        weights' shapes, before it is loaded. Nothing when they cannot be read (the load will say why)."""
        path = draft_path(config, artifact)
        try:
            s, numel = head_shape(path), _head_numel(path)
        except (ValueError, OSError, RuntimeError):
            return PoolShare()
        size = target_tensor(artifact.model, "norm", (s.hidden,)).element_size()
        per_token = 2 * s.kv_heads * s.head_dim * size
        bs = artifact.kv_cache_config.block_size
        seqs = artifact.scheduler_config.max_seqs * (config.num_tokens + bs)
        return PoolShare(per_block=bs * per_token, fixed=numel * size + seqs * per_token)

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        path = draft_path(config, artifact)
        try:
            shape, weights = read_checkpoint(path)
        except ValueError as e:
            raise ArtifactError(str(e)) from None
        model, mc = artifact.model, artifact.model_config
        kiln_file = path / "kiln.json"  # written by kiln compile; a raw checkpoint: its own eps (the target's)
        extra = json.loads(kiln_file.read_text(encoding="utf-8")) if kiln_file.is_file() else {}
        self.K = target_kernels(model)
        self.embed = target_tensor(model, "embed", (mc.vocab_size, shape.hidden), packed=True)  # K.embedding's
        self.lm_head = target_lm_head(model)
        norm = self.norm = target_tensor(model, "norm", (shape.hidden,))
        self.norm_eps = float(extra.get("target_norm_eps") or shape.eps)
        self.head = EagleHead(shape, weights, self.K, norm.dtype, norm.device, mc.max_model_len)
        bs = artifact.kv_cache_config.block_size
        tokens = runner.num_blocks * bs + artifact.scheduler_config.max_seqs * (config.num_tokens + bs)
        self.block_manager = BlockManager(cdiv(tokens, bs), bs)
        self.kv_cache = torch.zeros((self.block_manager.num_blocks, 2, bs, shape.kv_heads, shape.head_dim),
                                    dtype=norm.dtype, device=norm.device)
        self.kv: SeqStates[_HeadKV] = SeqStates(lambda seq: _HeadKV(shadow_sequence(seq)),
                                                lambda state: self.block_manager.free(state.shadow))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states (before its final norm) as the head reads them."""
        return self.K.rms_norm(hidden, self.norm, self.norm_eps)

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        self.kv.prune()
        want = dict(zip(wanting, limits, strict=True))
        rows: list[int] = []  # the step's hidden rows the head reads, sequence after sequence
        tokens: list[int] = []  # token t+1 of each
        entries: list[tuple[_HeadKV, int, int]] = []  # (state, first position, rows) of each sequence it runs
        chains: list[tuple[int, int, _HeadKV]] = []  # (batch index, last row, state) of each drafting sequence
        base = 0
        for i, (seq, n, start) in enumerate(zip(batch.seqs, batch.num_new_tokens, launched.starts, strict=True)):
            count = seq.num_computed_tokens - start  # valid rows: computed, token t+1 known
            lo, base = base, base + n
            if seq.is_finished:
                continue
            state = self.kv.get(seq)
            state.keep_below(start)
            if count <= 0:
                continue
            if not self.block_manager.allocate_slots(state.shadow, count + want.get(i, 1) - 1):
                self.block_manager.free(state.shadow)  # a full pool: its rows restart at the next step
                state.first, state.shadow.num_computed_tokens = seq.num_computed_tokens, 0
                continue
            rows.extend(range(lo, lo + count))
            tokens.extend(seq.token_ids[start + 1:start + 1 + count])
            entries.append((state, start, count))
            if i in want:
                chains.append((i, len(rows) - 1, state))
        if not entries:
            return [[] for _ in wanting]
        K, device = self.K, self.kv_cache.device
        with torch.inference_mode():
            fb = self._batch(entries, host_to_device(tokens, torch.int32, device))
            feats = self.features(launched.draft_input.hidden[host_to_device(rows, torch.int64, device)])
            f = self.head.forward(K.embedding(fb.input_ids, self.embed), feats, fb, self.kv_cache)
            for state, _, count in entries:
                state.shadow.num_computed_tokens += count
            if not chains:
                return [[] for _ in wanting]
            f = f[host_to_device([r for _, r, _ in chains], torch.int64, device)]
            tok = self.lm_head(f).argmax(-1)  # draft 1 of every chain
            live = list(range(len(chains)))
            rounds = [(live, tok)]
            for r in range(1, max(want[i] for i, _, _ in chains)):
                keep = [j for j, c in enumerate(live) if want[chains[c][0]] > r]
                if not keep:
                    break
                if len(keep) < len(live):
                    index = host_to_device(keep, torch.int64, device)
                    f, tok, live = f[index], tok[index], [live[j] for j in keep]
                # draft r + 1: the head at position num_computed + r - 1, on draft r and its own feature
                fb = self._batch([(chains[c][2], batch.seqs[chains[c][0]].num_computed_tokens + r - 1, 1)
                                  for c in live], tok.to(torch.int32), num_decodes=len(live))
                f = self.head.forward(K.embedding(fb.input_ids, self.embed), f, fb, self.kv_cache)
                tok = self.lm_head(f).argmax(-1)
                rounds.append((live, tok))
            flat = iter(torch.cat([t for _, t in rounds]).tolist())  # the one copy of the drafts to the host
        drafts: dict[int, list[int]] = {}
        for live, _ in rounds:
            for c in live:
                drafts.setdefault(chains[c][0], []).append(next(flat))
        return [drafts.get(i, []) for i in wanting]

    def _batch(self, entries: list[tuple[_HeadKV, int, int]], input_ids: torch.Tensor,
               num_decodes: int = 0) -> ForwardBatch:
        """The head's ForwardBatch of `entries` (state, position p, count): each sequence's rows at positions
        p, p + 1, ... after the rows its state holds below p; rotary positions in the sequence, slots and context
        in the head's pool."""
        bs = self.block_manager.block_size
        positions: list[int] = []
        slots: list[int] = []
        starts, lens = [0], []
        for state, start, count in entries:
            table, lo = state.shadow.block_table, start - state.first
            positions.extend(range(start, start + count))
            slots.extend(table[p // bs] * bs + p % bs for p in range(lo, lo + count))
            starts.append(starts[-1] + count)
            lens.append(lo + count)
        width = cdiv(max(lens), bs)
        tables = [state.shadow.block_table[:cdiv(n, bs)] + [-1] * (width - cdiv(n, bs))
                  for (state, _, _), n in zip(entries, lens, strict=True)]
        device = self.kv_cache.device

        def i32(values: list) -> torch.Tensor:
            return host_to_device(values, torch.int32, device)

        return ForwardBatch(input_ids=input_ids, positions=i32(positions), query_start_loc=i32(starts),
                            seq_lens=i32(lens), block_tables=i32(tables),
                            slot_mapping=host_to_device(slots, torch.int64, device), logits_indices=i32([]),
                            num_decodes=num_decodes)
