"""Multi-LoRA serving: PEFT adapters read from disk, paged into a fixed number of device slots by LRU.

The artifact's manifest lists the adapted linears (`lora.targets`, from the compiler's lora_injection pass):
each is one linear of a block — a fused q/k/v or gate/up linear is several PEFT modules side by side. For
every target the manager holds, per layer and slot, A [slots, m*R, K] and B [slots, N, m*R] (m modules,
R = max_rank): module j's lora_A fills rows j*R.. of A, its lora_B (times the adapter's scaling) the block of
B at its output rows and columns j*R..; the rest is zero. The generated model adds, for each token of a slot,
(x @ A[slot].T) @ B[slot].T to the linear's output (the `lora` kernel), so modules an adapter leaves out,
and ranks below R, contribute exact zeros. The cpu kernel reads each adapter's token rows (`LoRABatch.segments`);
the Triton kernel of GPU targets reads the same segments packed into one device tensor (`LoRABatch.segmented`:
rows grouped by adapter, each segment's slot and rank per target), two launches per linear for all adapters.

An adapter is loaded once into host memory (`load`), and copied into a slot when a step needs it and it is
not resident (`prepare`): the least recently used slot no running sequence needs is reused. The scheduler
keeps the running sequences' adapters within `max_loras` (Scheduler.max_loras), so a step always fits.

On a tensor-parallel mesh (a manifest target's `shard`) each rank's manager holds its slice of every adapter
(`shard_adapter`: B's output rows of a column-parallel linear, A's input columns of a row-parallel one) in slots
of the rank's local shapes; rank 0's manager plans (`assign`) and the other ranks page into the slots it chose
(`batch`), told by the mesh executor (runtime/worker/distributed/executor.py, commands.py).
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import KilnRuntimeError, RequestError
from .lora_files import (
    CONFIG_FILE,
    CONFIG_MAX_BYTES,
    WEIGHTS_FILE,
    AdapterFileError,
    confine,
    read_bounded,
    resolve_roots,
)

PEFT_PREFIX = "base_model.model."


class LoRAError(KilnRuntimeError):
    """An adapter that cannot be served: unreadable, of a kind kiln does not run, or not fitting the artifact."""


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One adapted linear (a manifest `lora.targets` entry)."""

    name: str  # the lora node's target: the weight param, e.g. "decoder.wqkv"
    block: str
    num_layers: int
    first_layer: int  # `{i}` in `modules` is the global layer index first_layer + local layer
    in_features: int
    modules: tuple[str, ...]  # PEFT module paths, e.g. "model.layers.{i}.self_attn.q_proj"
    rows: tuple[int, ...]  # output rows of each module
    # tensor parallelism (the manifest's `shard`): the dim of the [N, K] delta each rank holds a slice of (0: B's
    # output rows, a column-parallel linear; 1: A's input columns, a row-parallel one) and each rank's
    # [start, stop) runs of it; None: every rank holds the whole branch
    shard_dim: int | None = None
    shard_ranges: tuple[tuple[tuple[int, int], ...], ...] = ()

    @classmethod
    def from_manifest(cls, t: Mapping[str, Any]) -> LoRATarget:
        shard = t.get("shard")
        return cls(t["name"], t["block"], int(t["num_layers"]), int(t["first_layer"]), int(t["in_features"]),
                   tuple(t["modules"]), tuple(int(r) for r in t["rows"]),
                   None if shard is None else int(shard["dim"]),
                   () if shard is None else tuple(tuple((int(a), int(b)) for a, b in runs)
                                                  for runs in shard["ranges"]))

    def rank_index(self, rank: int) -> torch.Tensor | None:
        """The global indices of the sharded dim rank `rank` holds, in its local order (None: not sharded)."""
        if self.shard_dim is None:
            return None
        if not 0 <= rank < len(self.shard_ranges):
            raise LoRAError(f"lora target {self.name}: no shard for rank {rank} ({len(self.shard_ranges)} ranks)")
        return torch.cat([torch.arange(a, b) for a, b in self.shard_ranges[rank]])

    def local_shape(self, rank: int) -> tuple[int, int]:
        """(N, K) of the rank's slice of the [N, K] delta."""
        n, k = sum(self.rows), self.in_features
        index = self.rank_index(rank)
        if index is None:
            return n, k
        return (len(index), k) if self.shard_dim == 0 else (n, len(index))


@dataclass(slots=True)
class Adapter:
    """A loaded adapter: per target it adapts, host tensors A [layers, m*R, K] and B [layers, N, m*R]."""

    name: str
    lora_id: int  # unique per load: a reloaded name is another adapter (and another prefix-cache root)
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ranks: dict[str, int] = field(default_factory=dict)  # per target it adapts: its modules' largest rank


@dataclass(frozen=True, slots=True)
class SegmentedRows:
    """A step's adapter rows as a segmented kernel reads them (device int32 tensors): `rows`, the token rows of
    every adapter of the step grouped by adapter (segment s holds rows[indptr[s]:indptr[s + 1]], all of slot
    slots[s]); `ranks[target_index[t], s]`, the rank segment s's adapter has at target t (0: it leaves t
    alone). Rows of the base model are in no segment."""

    rows: torch.Tensor  # [P] token rows, segment after segment
    indptr: torch.Tensor  # [S + 1]
    slots: torch.Tensor  # [S]
    ranks: torch.Tensor  # [targets, S]
    target_index: Mapping[str, int]
    max_rows: int  # the longest segment's row count (a kernel's grid covers it)


@dataclass(slots=True)
class LoRABatch:
    """What the `lora` kernel reads in one step: every target's slot tensors, and for each adapter of the step
    (slot, the token rows it owns — None when it owns all of them —, the targets it adapts)."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # target -> (A [L, S, mR, K], B [L, S, N, mR])
    segments: list[tuple[int, torch.Tensor | None, frozenset[str]]] = field(default_factory=list)
    # the same segments as host lists, for `segmented`: each adapter's token rows and its rank per target
    seg_rows: list[list[int]] = field(default_factory=list)
    seg_ranks: dict[str, list[int]] = field(default_factory=dict)  # target -> rank of each segment's adapter
    _segmented: dict[torch.device, SegmentedRows] = field(default_factory=dict)

    def segmented(self, device: torch.device) -> SegmentedRows:
        """The segments as one packed int32 tensor on `device` (one host-to-device copy per step, made by the
        first kernel that asks and shared by every layer's)."""
        cached = self._segmented.get(device)
        if cached is not None:
            return cached
        from .interface import host_to_device

        num = len(self.seg_rows)
        indptr = [0]
        for rows in self.seg_rows:
            indptr.append(indptr[-1] + len(rows))
        slots = [slot for slot, _, _ in self.segments]
        names = list(self.seg_ranks)
        flat = [*indptr, *slots, *(r for t in names for r in self.seg_ranks[t]),
                *(row for rows in self.seg_rows for row in rows)]
        packed = host_to_device(flat, torch.int32, device)
        ranks_at = 2 * num + 1
        rows_at = ranks_at + num * len(names)
        seg = SegmentedRows(rows=packed[rows_at:], indptr=packed[:num + 1], slots=packed[num + 1:ranks_at],
                            ranks=packed[ranks_at:rows_at].view(len(names), num),
                            target_index={t: i for i, t in enumerate(names)},
                            max_rows=max((len(r) for r in self.seg_rows), default=0))
        self._segmented[device] = seg
        return seg


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module path's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, refused (LoRAError) where kiln would compute something else."""
    file = path / CONFIG_FILE
    try:
        cfg = json.loads(read_bounded(file, CONFIG_MAX_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise LoRAError(f"{path}: not a PEFT adapter (no {CONFIG_FILE})") from None
    except AdapterFileError as e:
        raise LoRAError(str(e)) from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{file}: cannot read it: {e}") from None
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAError(f"{file}: peft_type {kind!r} is not served (kiln serves LoRA adapters)")
    refused = {
        "use_dora": "DoRA adapters (use_dora) are not supported: their magnitude vector rescales the whole "
                    "adapted weight, which a low-rank branch added to the output cannot express",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights, GPT-2) is not supported",
        "modules_to_save": "modules_to_save (fully fine-tuned copies of modules) is not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise LoRAError(f"{file}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{file}: bias = {cfg['bias']!r} (trained biases) is not supported; only bias = \"none\"")
    for key in ("lora_bias", "use_qalora"):
        if cfg.get(key):
            raise LoRAError(f"{file}: {key} is not supported")
    if not isinstance(cfg, dict):
        raise LoRAError(f"{file}: not a JSON object")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise LoRAError(f"{file}: r must be a positive int, got {cfg.get('r')!r}")
    return cfg


def max_adapter_bytes(targets: Sequence[LoRATarget], max_rank: int) -> int:
    """The most bytes a safetensors adapter that fits `targets` can take: every module of every target at
    `max_rank` in float64, plus 16 MiB of header."""
    elements = sum(t.num_layers * max_rank * (len(t.modules) * t.in_features + sum(t.rows)) for t in targets)
    return 8 * elements + (16 << 20)


def read_adapter(path: str | Path, targets: Sequence[LoRATarget], max_rank: int, dtype: torch.dtype,
                 name: str = "", lora_id: int = 0) -> Adapter:
    """Reads a PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) into the slot layout of
    `targets`. Each lora_A / lora_B tensor must belong to a module of a target (else the adapter adapts
    something this artifact has no branch for: refused, naming it); ranks above `max_rank` are refused; the
    scaling (lora_alpha / r, or / sqrt(r) with use_rslora; rank_pattern / alpha_pattern per module) is folded
    into B."""
    from safetensors.torch import load

    path = Path(path)
    cfg = read_adapter_config(path)
    file = path / WEIGHTS_FILE
    try:
        data = read_bounded(file, max_adapter_bytes(targets, max_rank))
    except FileNotFoundError:
        raise LoRAError(f"{path}: no {WEIGHTS_FILE} (kiln reads safetensors adapters)") from None
    except (AdapterFileError, OSError) as e:
        raise LoRAError(str(e) if isinstance(e, AdapterFileError) else f"{file}: cannot read it: {e}") from None
    try:
        tensors = load(data)
    except Exception as e:  # noqa: BLE001 - a corrupt file, whatever safetensors says about it
        raise LoRAError(f"{file}: cannot read it: {e}") from None
    adaptable = sorted({mod.rsplit(".", 1)[-1] for t in targets for mod in t.modules})
    listed = cfg.get("target_modules")
    for module in listed if isinstance(listed, list) else ():  # a str is a regex over module paths
        if module.rsplit(".", 1)[-1] not in adaptable:
            raise LoRAError(f"{path / CONFIG_FILE}: targets module {module!r}, which this artifact has no LoRA "
                            f"branch for (adaptable: {', '.join(adaptable) or 'none'})")
    where: dict[str, tuple[LoRATarget, int, int]] = {}  # module path -> (target, module index, local layer)
    for t in targets:
        for j, module in enumerate(t.modules):
            for layer in range(t.num_layers):
                where[module.replace("{i}", str(t.first_layer + layer))] = (t, j, layer)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight", key)
        if m is None:
            raise LoRAError(f"{file}: tensor {key!r} is not a LoRA A/B weight kiln can serve "
                            "(embedding LoRA and trained biases are not supported)")
        if m.group(1) not in where:
            raise LoRAError(f"{file}: adapts module {m.group(1)!r}, which this artifact has no LoRA branch for "
                            f"(adaptable: {', '.join(adaptable) or 'none'})")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not pairs:
        raise LoRAError(f"{file}: holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ranks: dict[str, int] = {}
    top_rank = 0
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{file}: module {module!r} has lora_{'A' if 'A' in ab else 'B'} but not its pair")
        t, j, layer = where[module]
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != t.in_features or b.shape != (t.rows[j], r):
            raise LoRAError(f"{file}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a "
                            f"[{t.rows[j]}, {t.in_features}] projection")
        if r > max_rank:
            raise LoRAError(f"{file}: {module} has rank {r}, above this artifact's lora.max_rank = {max_rank}")
        top_rank = max(top_rank, r)
        ranks[t.name] = max(ranks.get(t.name, 0), r)
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", 8))
        r_cfg = _pattern_value(cfg.get("rank_pattern") or {}, module, cfg["r"])
        scaling = alpha / math.sqrt(r_cfg) if cfg.get("use_rslora") else alpha / r_cfg
        if t.name not in weights:
            m_r = len(t.modules) * max_rank
            weights[t.name] = (torch.zeros(t.num_layers, m_r, t.in_features, dtype=dtype),
                               torch.zeros(t.num_layers, sum(t.rows), m_r, dtype=dtype))
        big_a, big_b = weights[t.name]
        row = sum(t.rows[:j])
        big_a[layer, j * max_rank:j * max_rank + r] = a.to(dtype)
        big_b[layer, row:row + t.rows[j], j * max_rank:j * max_rank + r] = (b.double() * scaling).to(dtype)
    return Adapter(name=name, lora_id=lora_id, path=str(path), rank=top_rank, weights=weights, ranks=ranks)


def shard_adapter(adapter: Adapter, targets: Sequence[LoRATarget], rank: int) -> Adapter:
    """`adapter` as tensor-parallel rank `rank` holds it: each sharded target's B cut to the rank's output rows
    (column-parallel) or A to its input columns (row-parallel); the other factor whole. In place; returned."""
    for t in targets:
        index = t.rank_index(rank)
        if index is None or t.name not in adapter.weights:
            continue
        a, b = adapter.weights[t.name]
        if t.shard_dim == 0:
            b = b.index_select(1, index).contiguous()
        else:
            a = a.index_select(2, index).contiguous()
        adapter.weights[t.name] = (a, b)
    return adapter


class LoRAManager:
    """The adapters a core serves (by name) and the `max_loras` device slots they are paged into.

    Mutated only by the engine core's thread: `load` / `unload` (between steps) and `prepare` (per step).

    On a tensor-parallel mesh every rank has one, holding its slice of each adapter (`rank`; the slot tensors are
    the rank's local shapes). Rank 0's plans: it names adapters, gives them ids and chooses each step's slots
    (`assign`); the other ranks' load and unload by the ids rank 0 gave (`load(..., lora_id=)`) and page into the
    slots rank 0 chose (`batch`), told by the mesh executor's commands (runtime/worker/distributed/commands.py).
    `listeners` hear rank 0's loads and unloads (`listener("load", adapter)` may refuse one with LoRAError: the
    load is undone)."""

    def __init__(self, manifest_lora: Mapping[str, Any], device: torch.device, dtype: torch.dtype,
                 artifact_dir: Path | None = None, rank: int = 0) -> None:
        self.max_loras = int(manifest_lora["max_loras"])
        self.max_rank = int(manifest_lora["max_rank"])
        self.targets = [LoRATarget.from_manifest(t) for t in manifest_lora["targets"]]
        self.device, self.dtype, self.rank = device, dtype, rank
        s, m_r = self.max_loras, self.max_rank
        shapes = {t.name: t.local_shape(rank) for t in self.targets}
        self.slot_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            t.name: (torch.zeros(t.num_layers, s, len(t.modules) * m_r, shapes[t.name][1], dtype=dtype, device=device),
                     torch.zeros(t.num_layers, s, shapes[t.name][0], len(t.modules) * m_r, dtype=dtype, device=device))
            for t in self.targets}
        self.adapters: dict[str, Adapter] = {}
        self._by_id: dict[int, Adapter] = {}
        self._next_id = 1
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # planned lora_id -> slot, least recent first
        self._free_slots = list(range(s))
        self._resident: list[int | None] = [None] * s  # the adapter whose weights each slot holds
        self.num_loads = 0  # adapters copied into a slot (paging-in events)
        self.listeners: list = []
        for name, rel in (manifest_lora.get("adapters") or {}).items():
            self.load(name, (artifact_dir / rel) if artifact_dir is not None else Path(rel))

    # Adapters -------------------------------------------------------------------------------------------
    def read(self, path: str | Path, name: str = "", lora_id: int = 0) -> Adapter:
        """This rank's slice of the adapter at `path` (LoRAError); changes nothing, so any thread may call it."""
        adapter = read_adapter(path, self.targets, self.max_rank, self.dtype, name=name, lora_id=lora_id)
        return shard_adapter(adapter, self.targets, self.rank)

    def load(self, name: str, path: str | Path, lora_id: int | None = None, adapter: Adapter | None = None) -> Adapter:
        """Reads the adapter at `path` (this rank's slice; `adapter`: `read` already did, off the loop) and serves
        it as `name`, with id `lora_id` (a rank mirroring rank 0) or the next one (LoRAError: nothing changes)."""
        if name in self.adapters:
            raise LoRAError(f"adapter {name!r} is already loaded (unload it first)")
        lora_id = self._next_id if lora_id is None else lora_id
        adapter = self.read(path, name, lora_id) if adapter is None else replace(adapter, name=name, lora_id=lora_id)
        self._next_id = max(self._next_id, lora_id + 1)
        self.adapters[name] = adapter
        self._by_id[adapter.lora_id] = adapter
        try:
            for listener in self.listeners:
                listener("load", adapter)
        except BaseException:  # refused by another rank (LoRAError), or the mesh failed: not served
            self._forget(name)
            raise
        return adapter

    def unload(self, name: str) -> Adapter:
        """Stops serving `name` (the engine first makes sure no request uses it); its slot becomes free."""
        if name not in self.adapters:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        adapter = self._forget(name)
        for listener in self.listeners:
            listener("unload", adapter)
        return adapter

    def _forget(self, name: str) -> Adapter:
        adapter = self.adapters.pop(name)
        del self._by_id[adapter.lora_id]
        slot = self._slot_of.pop(adapter.lora_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._resident = [None if r == adapter.lora_id else r for r in self._resident]
        return adapter

    def unload_id(self, lora_id: int) -> None:
        """A mirroring rank's unload (by rank 0's id; an id it does not hold is already gone)."""
        adapter = self._by_id.get(lora_id)
        if adapter is not None:
            self._forget(adapter.name)

    def lora_id(self, name: str) -> int:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRAError(f"no adapter named {name!r}")
        return adapter.lora_id

    def names(self) -> list[str]:
        return list(self.adapters)

    # Slots ----------------------------------------------------------------------------------------------
    def slot_of(self, lora_id: int) -> int | None:
        return self._slot_of.get(lora_id)

    def _plan_slot(self, lora_id: int, needed: set[int]) -> int:
        """The slot `lora_id` runs in this step: its own if resident, else a free one, else the least recently
        used slot no adapter of the step needs."""
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop(0)
        else:
            victim = next((i for i in self._slot_of if i not in needed), None)
            assert victim is not None, f"{len(needed)} adapters in one step, {self.max_loras} slots"
            slot = self._slot_of.pop(victim)
        self._slot_of[lora_id] = slot
        return slot

    def _page_in(self, lora_id: int, slot: int) -> None:
        """Copies the adapter's weights into `slot` unless the slot already holds them."""
        if self._resident[slot] == lora_id:
            return
        adapter = self._by_id.get(lora_id)
        if adapter is None:
            raise LoRAError(f"adapter id {lora_id} is not loaded on rank {self.rank}")
        for t in self.targets:
            a, b = self.slot_weights[t.name]
            if t.name in adapter.weights:
                host_a, host_b = adapter.weights[t.name]
                a[:, slot].copy_(host_a, non_blocking=True)
                b[:, slot].copy_(host_b, non_blocking=True)
            else:  # stale weights of the slot's last adapter must not leak into this one
                a[:, slot].zero_()
                b[:, slot].zero_()
        self._resident[slot] = lora_id
        self.num_loads += 1

    @staticmethod
    def _rows_of(token_adapters: Sequence[tuple[int | None, int, int]]) -> dict[int, list[int]]:
        rows_of: dict[int, list[int]] = {}
        for lora_id, start, n in token_adapters:
            if lora_id is not None:
                rows_of.setdefault(lora_id, []).extend(range(start, start + n))
        return rows_of

    def assign(self, token_adapters: Sequence[tuple[int | None, int, int]]) -> dict[int, int]:
        """Rank 0's plan of a step: the slot of each adapter the step's sequences use ((lora id or None, first
        token row, row count) of each), chosen by LRU; nothing is copied (`batch` pages them in)."""
        rows_of = self._rows_of(token_adapters)
        needed = set(rows_of)
        return {lora_id: self._plan_slot(lora_id, needed) for lora_id in rows_of}

    def batch(self, slots: Mapping[int, int], token_adapters: Sequence[tuple[int | None, int, int]],
              num_tokens: int) -> LoRABatch | None:
        """The step's LoRABatch with each adapter in the slot `slots` gives it (paged in where the slot holds
        another); None when no sequence of the step has an adapter."""
        rows_of = self._rows_of(token_adapters)
        if not rows_of:
            return None
        segments = []
        seg_ranks: dict[str, list[int]] = {t.name: [] for t in self.targets}
        for lora_id, rows in rows_of.items():
            slot = slots[lora_id]
            self._page_in(lora_id, slot)
            index = None if len(rows) == num_tokens else torch.tensor(rows, dtype=torch.int64, device=self.device)
            adapter = self._by_id[lora_id]
            segments.append((slot, index, frozenset(adapter.weights)))
            for name, ranks in seg_ranks.items():
                ranks.append(adapter.ranks.get(name, 0))
        return LoRABatch(self.slot_weights, segments, list(rows_of.values()), seg_ranks)

    def prepare(self, token_adapters: Sequence[tuple[int | None, int, int]], num_tokens: int) -> LoRABatch | None:
        """The step's LoRABatch from (lora id or None, first token row, row count) of each sequence; pages in
        the adapters that are not resident. None when no sequence of the step has an adapter."""
        return self.batch(self.assign(token_adapters), token_adapters, num_tokens)


# The engine's side (EngineLoRA below; each refusal a RequestError the API turns into a 4xx) -------------
def lora_manager(manifest: Mapping[str, Any], artifact_dir: Path, device: torch.device,
                 rank: int = 0) -> LoRAManager | None:
    """The manager of an artifact compiled with `lora { }` (rank `rank`'s slices on a tensor-parallel mesh), its
    compiled-in adapters loaded; else None."""
    section = manifest.get("lora")
    if not section:
        return None
    return LoRAManager(section, device, getattr(torch, manifest["dtype"]), artifact_dir, rank)


def lora_request_id(manager: LoRAManager | None, name: str | None) -> int | None:
    """The adapter id a request named (None: the base model)."""
    if name is None:
        return None
    if manager is None:
        raise RequestError(f"this model serves no LoRA adapters (asked for {name!r})")
    try:
        return manager.lora_id(name)
    except LoRAError:
        raise RequestError(f"no LoRA adapter named {name!r} (loaded: {', '.join(manager.names()) or 'none'})") from None


class AdapterRefused(RequestError):
    """A refused adapter load, with the request field it is about and the HTTP status the API answers."""

    def __init__(self, message: str, param: str = "lora_path", status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def load_adapter(manager: LoRAManager | None, name: str, path: str | Path, shown: str | None = None,
                 adapter: Adapter | None = None) -> None:
    """Serves the adapter at `path` (`adapter`: read from there already) as `name` (AdapterRefused); `shown`
    stands for `path` in what it says."""
    check_load(manager, name)
    try:
        manager.load(name, path, adapter=adapter)
    except LoRAError as e:
        raise AdapterRefused(str(e) if shown is None else str(e).replace(str(path), shown)) from None


def check_load(manager: LoRAManager | None, name: str) -> None:
    """AdapterRefused unless `manager` can serve another adapter as `name`."""
    if manager is None:
        raise AdapterRefused("this artifact was compiled without `lora { }`: it has no adapter slots", "lora_name")
    if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise AdapterRefused(f"adapter name {name!r} must be letters, digits, '.', '_' or '-'", "lora_name")
    if name in manager.adapters:
        raise AdapterRefused(f"adapter {name!r} is already loaded (unload it first)", "lora_name")


def unload_adapter(manager: LoRAManager | None, name: str, seqs) -> None:
    if manager is None or name not in manager.adapters:
        raise RequestError(f"no LoRA adapter named {name!r} is loaded")
    lora_id = manager.adapters[name].lora_id
    busy = sum(1 for s in seqs if s.lora_id == lora_id and not s.is_finished)
    if busy:
        raise RequestError(f"adapter {name!r} is in use by {busy} running or waiting completion(s); retry when "
                           "they are done")
    manager.unload(name)


class EngineLoRA:
    """EngineCore's LoRA side (engine.py): `lora`, the adapter manager of an artifact compiled with `lora { }`
    (None without), the adapter id a request names, and loading/unloading adapters between steps."""

    lora: LoRAManager | None = None
    lora_roots: tuple[Path, ...] | None = None  # where clients may load adapters from (None: they may not)

    def attach_lora(self, lora_roots: Sequence[str | Path] | None = None) -> None:
        """The artifact's adapters, paged into the model runner's slots; the scheduler keeps the running
        sequences' adapters within them. `lora_roots` (`kiln serve --enable-lora-loading --lora-roots`): the
        directories the `load_lora_adapter` utility may read adapters from (None: it refuses every load)."""
        try:
            self.lora_roots = None if lora_roots is None else resolve_roots(lora_roots)
        except AdapterFileError as e:
            raise RequestError(str(e)) from None
        art = self.artifact
        self.lora = lora_manager(art.manifest, art.path, art.device)
        if self.lora is not None:
            self.scheduler.max_loras = self.lora.max_loras
            self.runner.lora = self.lora

    def lora_request_id(self, name: str | None) -> int | None:
        return lora_request_id(self.lora, name)

    def list_lora_adapters(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serves the PEFT adapter at `path` as `name` from the next request on (RequestError: refused)."""
        load_adapter(self.lora, name, path)

    def client_adapter_path(self, path: str) -> Path:
        """Where a client's `load_lora_adapter` reads (lora_loads.py): only with run-time loading on and `path`
        under `lora_roots` (AdapterRefused, 403, otherwise)."""
        self.check_client_updates("lora_path")
        try:
            return confine(path, self.lora_roots)
        except AdapterFileError as e:
            raise AdapterRefused(str(e), "lora_path", 403) from None

    def check_client_updates(self, param: str) -> None:
        """AdapterRefused (403) unless clients may load and unload adapters (`lora_roots` set)."""
        if self.lora_roots is None:
            raise AdapterRefused("run-time LoRA adapter loading and unloading is off on this server (start it with "
                                 "--enable-lora-loading --lora-roots DIR)", param, 403)

    def unload_lora_adapter(self, name: str) -> None:
        """Stops serving `name`; refused (RequestError) while a request still decodes with it."""
        unload_adapter(self.lora, name, (s for r in self.requests.values() for s in r.seqs))
