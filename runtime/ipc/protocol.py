"""The engine-core protocol: typed msgspec messages between API servers (clients) and an engine core.

Clients send requests, aborts and utility calls; the core answers every add, and after each step sends each
client one `StepOutputs` holding that step's token deltas for its requests (never whole sequences). Messages
are msgpack-encoded tagged structs (no pickle); `PROTOCOL_VERSION` changes with any change here, and a core
refuses a client of another version. Request ids are the client's own: the core namespaces them per client.

Transport (see core/process.py, ipc/client.py): the core binds a ROUTER socket for input (each client a
DEALER whose identity names it) and connects a PUSH socket to each client's own PULL address, given in its
`Hello`. The launcher learns that the core is up from a `Ready` on a pipe.
"""
from __future__ import annotations

from typing import Any

import msgspec

from ..sampling_params import SamplingParams

PROTOCOL_VERSION = 10  # 2: SamplingParams.structured_output and .thinking; 3: NewRequest.lora_name;
# 4: CoreStats.spec_num_drafts; 5: CoreStats' KV offload tier counters; 6: CoreInfo's scheduler bounds
# (cores on other machines may differ); 7: SamplingParams.cache_salt, and prefix-cache keys (kv_events) are
# 16-byte digests (block_hash.py); 8: GrammarSpec.whitespace; 9: SeqDelta.embedding;
# 10: CoreInfo.embedding

# (token ids, logprobs, ranks) of one position: the chosen/actual token first, then the top-N.
TokenLogprobs = tuple[list[int], list[float], list[int]]


class RequestLimits(msgspec.Struct, frozen=True):
    """What a request is checked against before it is queued (validation.check_request)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int


class CoreConfig(msgspec.Struct, kw_only=True):
    """How a launcher starts a core (core/process.py: main). `engine` holds EngineCore keyword arguments;
    `num_threads` the core's intra-op threads (threads.py: None = every core this process may run on); `cpus`
    the CPUs the core pins itself to before it loads anything (None: the mask it inherits);
    `max_waiting` the sequences queued or preempted before an add is refused as overloaded; `stream_interval`
    how many new tokens of a completion the core holds back before it sends them (its first token and its end
    are sent at once; 1: every step's, see core/process.py: StreamCoalescer); `plugins`
    "module:function" or "/path/file.py:function" callables run with the EngineCoreProc before it serves
    (extensions, test hooks); `plugin_options` their settings, by plugin (e.g. runtime/disagg's "disagg": the KV
    transport and the address its receiver binds, for a core serving one role on the network)."""

    artifact: str
    device: str = "cpu"
    engine: dict[str, Any] = {}
    num_threads: int | None = None
    cpus: list[int] | None = None
    max_waiting: int = 1024
    stream_interval: int = 1
    input_address: str = ""
    heartbeat_interval: float = 0.5
    client_timeout: float = 30.0  # a client silent this long is gone: its requests are aborted
    parent_pid: int | None = None  # exit when this process is no longer our parent
    plugins: list[str] = []
    plugin_options: dict[str, Any] = {}


class CoreInfo(msgspec.Struct, kw_only=True):
    """What a client learns about the core it talks to (in `Ready` and `Welcome`)."""

    protocol_version: int
    kiln_version: str
    pid: int
    artifact: str
    input_address: str
    limits: RequestLimits
    max_waiting: int
    device: str
    target: str | None
    arch: str | None
    served_name: str | None
    tokenizer_dir: str | None
    kv_bytes: int
    async_scheduling: bool
    speculative: str | None
    num_threads: int
    max_seqs: int  # the scheduler's bounds: sequences running at once, tokens a step
    max_batched_tokens: int
    cpus: list[int] | None = None  # the CPUs the core runs on (its affinity mask)
    embedding: dict[str, Any] | None = None  # an embedding artifact's manifest `embedding` section (task = embed)


class CoreStats(msgspec.Struct, array_like=True):
    """The core's counters after its latest step (counts are of sequences; prefix-cache ones in blocks)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_nonfinite_logits: int = 0
    num_step_errors: int = 0
    spec_num_drafts: int = 0  # speculative verify steps (of one sequence with drafts)
    # the KV pool's blocks by state (offloaded: in the CPU offload tier) and the tier's cumulative traffic
    kv_blocks_free: int = 0
    kv_blocks_active: int = 0
    kv_blocks_leased: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_offloaded: int = 0
    kv_offload_offloaded: int = 0  # blocks copied to the tier
    kv_offload_restored: int = 0  # blocks copied back from it on a prefix hit
    kv_offload_offload_bytes: int = 0
    kv_offload_restore_bytes: int = 0


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one completion (`index` of a request's n) gained in one step: its new token ids, their logprobs
    (one entry per token) and new prompt logprobs (completion 0 only). `finish_reason` is set when the core
    ended it: "stop" (eos or a stop token, whose id is `stop_reason`; its text is never shown), "length",
    or "error" (then `error` says why, and every completion of the request ends). An embedding artifact's
    request ends with its `embedding` (core/pooling.py) and no token."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    embedding: list[float] | None = None


# Client -> core --------------------------------------------------------------------------------------------
class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: msgspec.Raw  # an encoded SamplingParams, decoded (and so checked) per request by the core
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter it decodes with (None: the base model)


class Hello(msgspec.Struct, tag=True, array_like=True):
    output_address: str
    protocol_version: int = PROTOCOL_VERSION


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """All of `requests` or none (answered by one `AddResult`)."""

    call_id: int
    requests: list[NewRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Ends requests (all their completions) and single completions (request id, index) at once; the core
    sends nothing more for them. Idempotent: unknown or finished ids are ignored."""

    request_ids: list[str] = []
    seqs: list[tuple[str, int]] = []


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Both ways: a client says it is alive; the core says it is, with its latest stats (see StepOutputs)."""

    version: int = 0
    stats: CoreStats | None = None


class Goodbye(msgspec.Struct, tag=True, array_like=True):
    pass


# Core -> client --------------------------------------------------------------------------------------------
class Welcome(msgspec.Struct, tag=True, array_like=True):
    info: CoreInfo | None
    error: str | None = None  # the core refused the client (protocol version)


class AddResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    error: str | None = None
    overloaded: bool = False  # refused for now (the queue is full), not for good


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One step's deltas for one client's requests, the core's stats after it (`version` numbers the core's
    stats updates, so a client keeps the newest of these and heartbeats), and (request id, seconds it waited
    in the core's queue) of the requests first scheduled in it."""

    version: int
    deltas: list[SeqDelta]
    stats: CoreStats
    scheduled: list[tuple[str, float]] = []


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


# Launcher pipe ---------------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    info: CoreInfo


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    message: str
    user_error: bool  # the artifact or the options are wrong (the CLI exits 2, without a traceback)


ClientMessage = Hello | AddRequests | Abort | UtilityCall | Heartbeat | Goodbye
CoreMessage = Welcome | AddResult | StepOutputs | UtilityResult | Heartbeat
LauncherMessage = Ready | StartupFailed

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
client_decoder = msgspec.msgpack.Decoder(CoreMessage)  # what a client receives
core_decoder = msgspec.msgpack.Decoder(ClientMessage)  # what a core receives
launcher_decoder = msgspec.msgpack.Decoder(LauncherMessage)
_params_decoder = msgspec.msgpack.Decoder(SamplingParams)


def encode_params(params: SamplingParams) -> msgspec.Raw:
    return msgspec.Raw(encode(params))


def decode_params(raw: msgspec.Raw) -> SamplingParams:
    """Decodes and checks (SamplingParams.__post_init__) one request's parameters; a bad value raises
    msgspec.ValidationError with SamplingParams' message."""
    return _params_decoder.decode(raw)
