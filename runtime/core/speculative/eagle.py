"""The `eagle` proposer: an EAGLE draft head drafting k tokens a step, EAGLE-1/2 (here) or EAGLE-3 (eagle3.py),
told apart by the checkpoint (`is_eagle3`).

An EAGLE-1/2 head (SafeAILab's published layout) is one Llama decoder layer after a projection `fc` of
[embedding(token t+1); target feature at t] (the target's last hidden state after its final norm) to a feature at
t+1; the target's LM head turns a feature into draft logits. It shares the target's embedding and LM head. Either
head keeps the KV of its one layer itself, paged (its own block pool, a block table per sequence); drafts 2..k
chain the head on its own output hidden state and the previous draft. The head runs by the target's kernel
library (its model.py's `K`), batched over every sequence of a step: one varlen forward over the step's tokens,
then one decode forward per chained draft.

`read_checkpoint` checks an EAGLE-1/2 checkpoint directory (config.json and fc.weight / layers.0.* in
model.safetensors or pytorch_model.bin), eagle3.py's `read_eagle3_checkpoint` an EAGLE-3 one; `kiln compile` runs
them for `speculative { method = eagle; draft = "hf:DIR" }` before storing the head in the artifact's eagle/
(EAGLE_DIR).
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

from ...config import SpeculativeConfig
from ...errors import ArtifactError
from ...forward_batch import ForwardBatch
from ...worker.model_runner import DraftInput, host_to_device
from ..kv_cache import BlockManager, cdiv
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


def _weights_file(path: Path) -> Path:
    file = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if file is None:
        raise ValueError(f"EAGLE checkpoint {path}: no weights ({' or '.join(WEIGHT_FILES)})")
    return file


def _weight_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape (names as published, without a `model.` prefix), from the file's header."""
    file = _weights_file(path)
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
    file = _weights_file(Path(path))
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
    return "eagle3" in archs or any(k.startswith("midlayer.") or k in ("d2t", "t2d") for k in _weight_shapes(path))


def _head_numel(path: Path, own: tuple[str, ...] = ("lm_head", "embed")) -> int:
    """Elements of the head's own weights: all but those it reads from the target (names starting with `own`'s)."""
    return sum(math.prod(shape) for k, shape in _weight_shapes(path).items() if not k.startswith(own))


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
    """Runs the head (`head`: an EagleHead, or eagle3.py's Eagle3Head, whose target layers the target's forward
    then returns as `aux_layers`) over every token the target computed in the step (its KV must cover each computed
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
        """One KV layer per target token slot, plus k + a block per sequence, and the head's weights (all but what
        it reads from the target: the embedding, and an EAGLE-1/2 head's LM head), in the target's dtype, and an
        EAGLE-3 head's draft-to-target id table (int64): from its config and its weights' shapes, before it is
        loaded. Nothing when they cannot be read (the load will say why)."""
        path = draft_path(config, artifact)
        try:
            s = head_shape(path)
            eagle3 = is_eagle3(path)
            numel = _head_numel(path, ("embed", "d2t", "t2d") if eagle3 else ("lm_head", "embed"))
            ids = math.prod(_weight_shapes(path).get("d2t", [0])) if eagle3 else 0
            embed = target_tensor(artifact.model, "embed", (artifact.model_config.vocab_size, s.hidden), packed=True)
        except (ValueError, OSError, RuntimeError, ArtifactError):
            return PoolShare()
        size = torch.empty((), dtype=embed.dtype).element_size()
        per_token = 2 * s.kv_heads * s.head_dim * size
        bs = artifact.kv_cache_config.block_size
        seqs = artifact.scheduler_config.max_seqs * (config.num_tokens + bs)
        return PoolShare(per_block=bs * per_token, fixed=numel * size + ids * 8 + seqs * per_token)

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        path = draft_path(config, artifact)
        model, mc = artifact.model, artifact.model_config
        self.K = target_kernels(model)
        try:
            if is_eagle3(path):
                from .eagle3 import load_eagle3_head

                self.head = load_eagle3_head(path, artifact, self.K)
            else:
                shape, weights = read_checkpoint(path)
                kiln_file = path / "kiln.json"  # written by kiln compile; a raw checkpoint: its own eps (the target's)
                extra = json.loads(kiln_file.read_text(encoding="utf-8")) if kiln_file.is_file() else {}
                self.head = EagleHead(shape, weights, model, self.K, mc.max_model_len,
                                      float(extra.get("target_norm_eps") or shape.eps))
        except ValueError as e:
            raise ArtifactError(str(e)) from None
        shape = self.head.shape
        self.aux_layers = self.head.aux_layers
        self.embed = target_tensor(model, "embed", (mc.vocab_size, shape.hidden), packed=True)  # K.embedding's
        bs = artifact.kv_cache_config.block_size
        tokens = runner.num_blocks * bs + artifact.scheduler_config.max_seqs * (config.num_tokens + bs)
        self.block_manager = BlockManager(cdiv(tokens, bs), bs)
        self.kv_cache = torch.zeros((self.block_manager.num_blocks, 2, bs, shape.kv_heads, shape.head_dim),
                                    dtype=self.embed.dtype, device=artifact.device)
        self.kv: SeqStates[_HeadKV] = SeqStates(lambda seq: _HeadKV(shadow_sequence(seq)),
                                                lambda state: self.block_manager.free(state.shadow))

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
            hidden = self.head.start(launched.draft_input, host_to_device(rows, torch.int64, device))
            f = self.head.forward(K.embedding(fb.input_ids, self.embed), hidden, fb, self.kv_cache)
            for state, _, count in entries:
                state.shadow.num_computed_tokens += count
            if not chains:
                return [[] for _ in wanting]
            f = f[host_to_device([r for _, r, _ in chains], torch.int64, device)]
            tok = self.head.draft(f)  # draft 1 of every chain
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
                tok = self.head.draft(f)
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
