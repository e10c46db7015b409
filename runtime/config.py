"""Runtime configuration read from an artifact's manifest, with per-launch overrides."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from .errors import ArtifactError
from .manifest import MLA_LAYOUT, SPECULATIVE_METHODS

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
    "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ArtifactError(f"unsupported dtype {name!r} in manifest (known: {', '.join(_DTYPES)})") from None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    max_model_len: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Shape of the paged KV cache: `num_layers` tensors of [num_blocks, 2, block_size, kv_heads, head_dim], or
    for MLA (`latent_dim` > 0) [num_blocks, block_size, latent_dim]."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_blocks: int | None  # None: sized from a memory budget at load time
    latent_dim: int = 0  # MLA: > 0, and each tensor is [num_blocks, block_size, latent_dim] (kv_lora_rank + rope dim)
    pool_bytes: int | None = None  # the compile's byte budget for the pool (cpu); None: from device memory
    offload_bytes: int = 0  # the CPU offload tier's host memory (kv_cache { offload = cpu(SIZE) }); 0: none

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's KV tensor shape, without the leading num_blocks."""
        if self.latent_dim:
            return (self.block_size, self.latent_dim)
        return (2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * math.prod(self.shape) * elem


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The manifest's `scheduler` section (every field explicit: the compiler fills the recipe's defaults), with
    per-launch overrides."""

    max_seqs: int
    max_batched_tokens: int
    chunked_prefill: int | None  # max prompt tokens of one sequence per step; None = only the budget
    policy: str  # fcfs | priority | effort
    prefix_cache: str | None  # "radix"; None disables
    preemption: str  # recompute | swap: a preempted sequence's KV is copied to CPU memory
    swap_space: int  # bytes of CPU memory for swapped-out KV blocks (preemption = swap)
    async_scheduling: bool | None  # overlap host work with the device (LLMEngine); None: on for CUDA
    # which sequences are admitted only with KV for their whole budget, and never preempted (scheduler.py):
    # none | reasoning (those with a thinking budget) | all
    kv_reserve: str = "reasoning"

    def with_overrides(self, **overrides: Any) -> SchedulerConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _get(section: dict, key: str, where: str) -> Any:
    if key not in section:
        raise ArtifactError(f"manifest.json: missing {where}.{key}")
    return section[key]


def model_config_from_manifest(manifest: dict) -> ModelConfig:
    rt = manifest["runtime"]
    eos = rt.get("eos_token_ids", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    return ModelConfig(vocab_size=int(_get(rt, "vocab_size", "runtime")),
                       max_model_len=int(_get(rt, "max_model_len", "runtime")),
                       bos_token_id=rt.get("bos_token_id"), eos_token_ids=tuple(eos))


def kv_cache_config_from_manifest(manifest: dict) -> KVCacheConfig:
    """The KV geometry of a manifest that `validate_manifest` accepted (layout and its fields present)."""
    kv = manifest["kv_cache"]
    num_blocks, pool = kv.get("num_blocks"), kv.get("pool_bytes")
    common = {"num_layers": int(kv["num_layers"]), "block_size": int(kv["block_size"]),
              "dtype": torch_dtype(kv["dtype"]), "num_blocks": None if num_blocks is None else int(num_blocks),
              "pool_bytes": None if pool is None else int(pool), "offload_bytes": int(kv.get("offload_bytes") or 0)}
    if list(kv["layout"]) == MLA_LAYOUT:
        return KVCacheConfig(kv_heads=1, head_dim=int(kv["latent_dim"]), latent_dim=int(kv["latent_dim"]), **common)
    return KVCacheConfig(kv_heads=int(kv["kv_heads"]), head_dim=int(kv["head_dim"]), **common)


def scheduler_config_from_manifest(manifest: dict) -> SchedulerConfig:
    s = manifest["scheduler"]
    return SchedulerConfig(max_seqs=int(s["max_seqs"]), max_batched_tokens=int(s["max_batched_tokens"]),
                           chunked_prefill=None if s["chunked_prefill"] is None else int(s["chunked_prefill"]),
                           policy=str(s["policy"]), prefix_cache=None if s["prefix_cache"] == "none" else "radix",
                           preemption=str(s["preemption"]), swap_space=int(s["swap_space"]),
                           async_scheduling=s["async_scheduling"],
                           kv_reserve=str(s.get("kv_reserve", "reasoning")))  # artifacts before it: the default


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (runtime/core/speculative/): `method` proposes up to `num_tokens` drafts a step.

    Methods: a draft head compiled into the artifact (manifest `drafts`, e.g. DeepSeek's "mtp"; `model_method` is
    its model.py method), "ngram" (prompt lookup of the last `ngram_max` down to `ngram_min` tokens), "draft" (the
    compiled artifact `draft_model`, a smaller model sharing the tokenizer), "eagle" (`draft_model`: an EAGLE head)."""

    method: str
    model_method: str | None = None
    num_tokens: int = 1
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None


def speculative_config(manifest: dict, method: str | None, num_tokens: int | None = None,
                       draft_model: str | None = None) -> SpeculativeConfig | None:
    """`method` (None or "none": off) checked against what the artifact has: a draft head of that name, or a
    draft model for "draft"; `num_tokens` drafts a step (default: the manifest's, else 1)."""
    if method in (None, "none"):
        return None
    if num_tokens is None:
        num_tokens = (manifest.get("speculative") or {}).get("num_tokens")
    n = 1 if num_tokens is None else int(num_tokens)
    if n < 1:
        raise ArtifactError(f"speculative {method}: {n} draft tokens per step; at least 1")
    if method == "ngram":
        return SpeculativeConfig(method, num_tokens=n)
    if method in ("draft", "eagle"):
        draft_model = draft_model or (manifest.get("speculative") or {}).get("draft_model")
        if not draft_model and method == "eagle":
            raise ArtifactError("speculative eagle needs a draft head: give an EAGLE-1/2 or EAGLE-3 head's directory "
                                "(--speculative-model DIR, speculative_model=DIR, or the recipe's "
                                "`speculative { method = eagle; draft = \"hf:DIR\" }`)")
        if not draft_model:
            raise ArtifactError("speculative draft: no draft model; give the directory of a compiled artifact "
                                "sharing the target's tokenizer (--speculative-model DIR, speculative_model=DIR)")
        return SpeculativeConfig(method, num_tokens=n, draft_model=str(draft_model))
    if manifest.get("lora"):  # as the compiler refuses it (compiler/targets.py _lora_supported)
        raise ArtifactError(f"speculative {method}: a draft head with LoRA adapters is not supported (it reads "
                            "hidden states the adapters shift and has no adapter of its own); use ngram or draft")
    drafts = manifest.get("drafts") or {}
    if method not in drafts:
        have = ", ".join(drafts) or "none"
        raise ArtifactError(f"speculative method {method!r} needs a draft head of that name in the artifact "
                            f"(it has: {have}); compile a checkpoint with an MTP layer (DeepSeek-V3, nextn >= 1), "
                            f"or use one of {', '.join(SPECULATIVE_METHODS)}")
    if n != 1 and not drafts[method].get("chains"):
        raise ArtifactError(f"speculative {method}: {n} draft tokens per step; this artifact's head returns no "
                            "hidden state to chain on (compiled before chained MTP), so it proposes 1")
    if n != 1 and int((manifest.get("parallel") or {}).get("world_size", 1)) > 1:
        raise ArtifactError(f"speculative {method}: {n} draft tokens per step on a parallel artifact; chained "
                            "draft heads run on one device (use 1)")
    return SpeculativeConfig(method, str(drafts[method]["method"]), n)


@dataclass(frozen=True, slots=True)
class CUDAGraphConfig:
    """The manifest's `cuda_graphs` plan (GPU artifacts; passes/cuda_graph_plan.py): decode batches of up to
    max(batch_sizes) sequences replay a graph captured for the smallest bucket that holds them."""

    batch_sizes: tuple[int, ...]
    max_blocks_per_seq: int


def cuda_graph_config_from_manifest(manifest: dict) -> CUDAGraphConfig | None:
    plan = manifest.get("cuda_graphs")
    if not isinstance(plan, dict):
        return None
    sizes = tuple(sorted(int(b) for b in _get(plan, "batch_sizes", "cuda_graphs")))
    if not sizes or sizes[0] < 1 or len(set(sizes)) != len(sizes):
        raise ArtifactError(f"manifest.json: cuda_graphs.batch_sizes {list(sizes)} must be distinct positive ints")
    return CUDAGraphConfig(batch_sizes=sizes,
                           max_blocks_per_seq=int(_get(plan, "max_blocks_per_seq", "cuda_graphs")))
