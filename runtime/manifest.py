"""The schema of an artifact's `manifest.json`: what a runtime may rely on, checked once at load.

`kiln compile` (codegen/artifact.py) writes the manifest; `validate_manifest` is the one place that decides
whether a runtime can serve it. Every field the runtime reads is declared here with its range, so a hand edit
(`block_size = 0`, `max_seqs = 0`, a dtype the runtime has no tensor type for, a weights directory outside
the artifact) is refused with the field's path and the reason before anything is allocated or run.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ArtifactError

SCHEMA_VERSION = 2
MHA_LAYOUT = ["num_blocks", 2, "block_size", "kv_heads", "head_dim"]
MLA_LAYOUT = ["num_blocks", "block_size", "latent_dim"]  # per token [c_kv (kv_lora_rank) | k_pe (rope dim)]
TENSOR_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")  # activation and KV-cache dtypes
# safetensors header dtypes of the weights a kiln artifact stores
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F8_E4M3", "I32")

PosInt = Annotated[int, Field(strict=True, ge=1)]
NonNegInt = Annotated[int, Field(strict=True, ge=0)]


def _relative_path(value: str) -> str:
    """A path inside the artifact: relative, no `..`, so a manifest cannot point a load outside its directory."""
    p = PurePosixPath(value)
    if not value or p.is_absolute() or ".." in p.parts or "\\" in value:
        raise ValueError(f"must be a relative path inside the artifact, not {value!r}")
    return value


def _file_name(value: str) -> str:
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(f"must be a plain file name, not {value!r}")
    return value


def _identifier(value: str) -> str:
    if not value.isidentifier():
        raise ValueError(f"must be a Python identifier, not {value!r}")
    return value


RelPath = Annotated[str, AfterValidator(_relative_path)]
FileName = Annotated[str, AfterValidator(_file_name)]
Identifier = Annotated[str, AfterValidator(_identifier)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class RuntimeSection(_Section):
    vocab_size: PosInt
    max_model_len: PosInt
    bos_token_id: NonNegInt | None = None
    eos_token_ids: list[NonNegInt]

    @model_validator(mode="after")
    def _ids_in_vocab(self) -> RuntimeSection:
        for name, ids in (("bos_token_id", [] if self.bos_token_id is None else [self.bos_token_id]),
                          ("eos_token_ids", self.eos_token_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} outside the vocabulary of {self.vocab_size}")
        return self


class KVCacheSection(_Section):
    num_layers: PosInt
    block_size: PosInt
    dtype: Literal[TENSOR_DTYPES]
    layout: list[str | int]
    kv_heads: PosInt | None = None
    head_dim: PosInt | None = None
    latent_dim: PosInt | None = None
    bytes_per_token: PosInt
    memory_fraction: Annotated[float, Field(gt=0, le=1)]
    num_blocks: PosInt | None = None
    # the KV pool's byte budget the compile chose for the target (cpu); None: sized from device memory at load
    pool_bytes: PosInt | None = None
    offload_bytes: PosInt | None = None  # the CPU offload tier (runtime/core/kv_offload.py); absent: none

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, not {v}")
        return v

    @model_validator(mode="after")
    def _layout(self) -> KVCacheSection:
        if self.layout == MHA_LAYOUT:
            missing = [k for k in ("kv_heads", "head_dim") if getattr(self, k) is None]
        elif self.layout == MLA_LAYOUT:
            missing = [k for k in ("latent_dim",) if getattr(self, k) is None]
        else:
            raise ValueError(f"layout {self.layout} is not one this runtime allocates ({MHA_LAYOUT} or {MLA_LAYOUT})")
        if missing:
            raise ValueError(f"layout {self.layout} needs {', '.join(missing)}")
        return self


class SchedulerSection(_Section):
    """Every field explicit (the compiler fills the recipe's defaults): the runtime has none of its own."""

    max_seqs: PosInt
    max_batched_tokens: PosInt
    chunked_prefill: PosInt | None  # None: no chunking, only the token budget
    policy: Literal["fcfs", "priority", "effort"]
    prefix_cache: Literal["radix", "none"]
    preemption: Literal["recompute", "swap"]
    swap_space: NonNegInt
    async_scheduling: bool | None  # None: on for a CUDA device, off for CPU
    kv_reserve: Literal["reasoning", "all", "none"] = "reasoning"  # the one default: artifacts compiled before it


class WeightTensor(_Section):
    file: FileName
    dtype: Literal[WEIGHT_DTYPES]
    shape: list[NonNegInt]


class WeightsSection(_Section):
    dir: RelPath
    files: Annotated[list[FileName], Field(min_length=1)]
    sha256: dict[FileName, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]]
    # every stored tensor: {name: {"file", "dtype" (safetensors), "shape"}}; what the loader checks each file's
    # header against before reading a byte of data
    tensors: dict[str, WeightTensor]
    aliases: dict[str, str] = Field(default_factory=dict)
    total_bytes: NonNegInt

    @model_validator(mode="after")
    def _consistent(self) -> WeightsSection:
        if set(self.sha256) != set(self.files):
            raise ValueError(f"sha256 lists {sorted(self.sha256)}, files are {sorted(self.files)}")
        stray = sorted({t.file for t in self.tensors.values()} - set(self.files))
        if stray:
            raise ValueError(f"tensors are stored in {stray}, which files does not list")
        dangling = sorted(k for k, v in self.aliases.items() if v not in self.tensors)
        if dangling:
            raise ValueError(f"aliases {dangling} name tensors that are not stored")
        return self


class TokenizerSection(_Section):
    dir: RelPath


class EntrySection(_Section):
    module: Identifier
    class_: Identifier = Field(alias="class")


class CUDAGraphsSection(_Section):
    batch_sizes: Annotated[list[PosInt], Field(min_length=1)]
    max_blocks_per_seq: PosInt
    estimated_bytes: NonNegInt = 0

    @field_validator("batch_sizes")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"must be distinct, not {v}")
        return v


class DraftSection(_Section):
    method: Identifier
    first_kv_layer: NonNegInt
    num_kv_layers: NonNegInt
    num_hidden: NonNegInt
    chains: bool = False  # the head also returns its hidden state: applied again for drafts 2..k


# speculative methods that need no draft head in the artifact (runtime/core/speculative/)
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")


class SpeculativeSection(_Section):
    method: str | None  # None: off; a draft head's name (`drafts`) or one of SPECULATIVE_METHODS
    num_tokens: PosInt
    draft_model: str | None = None  # method draft / eagle: the draft artifact's / EAGLE head's directory, relative to this one


class LoRATargetSection(_Section):
    name: str
    block: str
    num_layers: PosInt
    first_layer: NonNegInt
    in_features: PosInt
    modules: list[str] = Field(min_length=1)
    rows: list[PosInt] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_row_count_per_module(self) -> LoRATargetSection:
        if len(self.rows) != len(self.modules):
            raise ValueError(f"{len(self.modules)} modules but {len(self.rows)} row counts")
        return self


class LoRASection(_Section):
    """Multi-LoRA serving (runtime/worker/lora.py): the device slots, the largest rank, the adapted linears, and the
    adapters compiled into the artifact (name -> their directory in it)."""

    max_loras: PosInt
    max_rank: PosInt
    targets: list[LoRATargetSection]
    adapters: dict[str, RelPath] = Field(default_factory=dict)


class ServeSection(_Section):
    host: Annotated[str, Field(min_length=1)]
    port: Annotated[int, Field(strict=True, ge=1, le=65535)]
    served_name: str | None  # None: the artifact directory's name
    # reasoning_effort -> thinking budget entries over the runtime's (thinking.effort_budgets); artifacts
    # compiled before it have none
    reasoning_effort: dict[str, NonNegInt] = Field(default_factory=dict)


class DisaggregateSection(_Section):
    prefill: Annotated[int, Field(strict=True, ge=1)]
    decode: Annotated[int, Field(strict=True, ge=1, le=1)]  # one decode core per router for now (or --replicas)
    transport: Literal["auto", "tcp", "nixl"]
    remote_prefill: Literal["always", "never", "auto"]


class ParallelParam(_Section):
    shape: list[NonNegInt]  # global
    placement: str  # compiler/placement.py's text form (R, S0[512x1], ...)
    local_shape: list[NonNegInt]  # what each rank holds


class ParallelSection(_Section):
    """A parallel artifact's mesh (compiler/placement.py `Mesh`) and what every rank holds: `ranks[r]` is rank r's
    weights section (weights/rank{r}/, each file's sha256 and every tensor's shape), checked like `weights` by
    the rank that loads it and by nobody else."""

    world_size: Annotated[int, Field(strict=True, ge=2)]
    tp: PosInt
    dp: PosInt
    ep: PosInt
    etp: PosInt
    attention: Literal["tp", "dp"]
    expert_placement: Literal["contiguous", "round_robin"]
    dense: Literal["sharded", "replicated"] = "sharded"  # dense MLPs under dp attention (compiler Mesh.dense)
    vocab: dict[str, PosInt]
    params: dict[str, ParallelParam]
    experts: dict[str, list[list[NonNegInt]]] = Field(default_factory=dict)  # stack -> each rank's global ids
    collectives: list[dict[str, Any]] = Field(default_factory=list)
    rank_weight_bytes: NonNegInt = 0
    ranks: list[WeightsSection]

    @model_validator(mode="after")
    def _mesh(self) -> ParallelSection:
        if self.tp * self.dp != self.world_size or self.ep * self.etp != self.world_size:
            raise ValueError(f"tp x dp = {self.tp} x {self.dp} and ep x etp = {self.ep} x {self.etp} must both be "
                             f"the world size {self.world_size}")
        if len(self.ranks) != self.world_size:
            raise ValueError(f"{len(self.ranks)} rank weight sections for {self.world_size} ranks")
        for r, rank in enumerate(self.ranks):
            if rank.dir != f"weights/rank{r}":
                raise ValueError(f"rank {r}'s weights are in {rank.dir!r}, not 'weights/rank{r}'")
        for name, ids in self.experts.items():
            if len(ids) != self.world_size:
                raise ValueError(f"experts {name!r}: {len(ids)} ranks listed for {self.world_size}")
        return self


class Manifest(_Section):
    schema_version: int
    kiln_version: str
    target: str  # the compile target's name (informational: `device` says where it loads)
    device: Literal["cpu", "cuda"]
    dtype: Literal[TENSOR_DTYPES]
    model: dict[str, Any] = Field(default_factory=dict)
    runtime: RuntimeSection
    kv_cache: KVCacheSection
    scheduler: SchedulerSection
    weights: WeightsSection
    tokenizer: TokenizerSection | None = None
    entry: EntrySection
    serve: ServeSection
    disaggregate: DisaggregateSection | None = None  # `kiln serve --disaggregate` (runtime/disagg)
    cuda_graphs: CUDAGraphsSection | None = None  # targets that capture CUDA graphs
    drafts: dict[str, DraftSection] = Field(default_factory=dict)
    speculative: SpeculativeSection
    lora: LoRASection | None = None  # recipes with `lora { }`
    parallel: ParallelSection | None = None  # a parallel artifact (tp x dp > 1 ranks)

    @model_validator(mode="after")
    def _drafts_fit(self) -> Manifest:
        for name, d in self.drafts.items():
            if d.first_kv_layer + d.num_kv_layers > self.kv_cache.num_layers:
                raise ValueError(f"draft {name!r} uses KV layers {d.first_kv_layer}..{d.first_kv_layer + d.num_kv_layers - 1}"
                                 f" of {self.kv_cache.num_layers}")
        if self.parallel is not None and self.parallel.ranks[0] != self.weights:
            raise ValueError("parallel.ranks[0] must be the `weights` section (rank 0's)")
        if self.speculative.method not in (None, *SPECULATIVE_METHODS) and self.speculative.method not in self.drafts:
            raise ValueError(f"speculative.method {self.speculative.method!r} is not one of the drafts "
                             f"({', '.join(self.drafts) or 'none'})")
        return self


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p not in ("function-after",)) or "(top level)"


def validate_manifest(data: Any, file: str = "manifest.json") -> Manifest:
    """The checked manifest; raises ArtifactError naming the first wrong fields (`kv_cache.block_size: ...`)."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{file}: expected a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{file}: artifact schema version {version!r} (kiln {data.get('kiln_version', '?')}) is not supported; "
            f"this runtime reads schema version {SCHEMA_VERSION}. Recompile the recipe with this kiln.")
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors()[:4]:
            msg = re.sub(r"^(Value error|Assertion failed), ", "", err["msg"])
            got = err.get("input")
            shown = "" if err["type"] == "missing" or isinstance(got, dict) else f" (got {_short(got)})"
            problems.append(f"{_where(err['loc'])}: {msg}{shown}")
        more = f"; and {e.error_count() - 4} more" if e.error_count() > 4 else ""
        raise ArtifactError(f"{file}: " + "; ".join(problems) + more + " — recompile the recipe, or undo the "
                            "edit") from None


def _short(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def read_manifest(path: str | Path) -> dict:
    """Reads `ART/manifest.json` and checks it against the schema (`validate_manifest`); raises `ArtifactError`
    on anything a runtime cannot serve."""
    art = Path(path)
    file = art / "manifest.json"
    if not file.is_file():
        raise ArtifactError(f"{art}: not a kiln artifact (no manifest.json); build one with `kiln compile`")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{file}: invalid JSON ({e})") from None
    validate_manifest(manifest, str(file))
    return manifest
