"""Mesh executors: run a parallel artifact's ranks for the engine (runtime/worker/executor.py's `Executor`).

Rank 0 lives in the engine's process: its ModelRunner plans each step (`plan`: host lists), the executor sends the
step to the other ranks (runtime/worker/distributed/commands.py) and runs rank 0's part, whose model returns the whole
step's logits (the LM head's all_gather is in the model). The block allocator and the scheduler are rank 0's
alone; every rank's KV pool has the same blocks, holding its own KV heads (tensor-parallel attention) or its own
sequences' latents (data-parallel attention, where rank 0 splits each step's sequences over the ranks).

Two ways to run the other ranks:
  ProcessMeshExecutor  one worker process per rank (`python -m kiln.runtime.worker.distributed.worker`), torch.distributed
                       gloo (CPU) / NCCL (CUDA); or ranks a torchrun-style launch started on other hosts.
  LocalMeshExecutor    every rank in this process, one thread each, on one device (the single-process mesh:
                       tests the sharded kernels on one GPU).
A rank that dies, or a collective that does not complete within KILN_DIST_TIMEOUT seconds, fails the executor:
`execute` raises ExecutorError then and at every later call (the engine fails its requests, a server exits).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...artifact import LoadedArtifact, load_artifact
from ...config import SchedulerConfig
from ...core.batch import LogitsLayout, ScheduledBatch, logit_candidates
from ...core.sequence import SequenceStatus
from ...errors import ArtifactError, KilnRuntimeError
from ..interface import DraftInput, ExecutorError, HostBatch
from ..lora import Adapter, LoRAError, LoRAManager
from ..memory_plan import describe_memory_plan, plan_memory, profile_lengths
from .comm import CommError, ProcessGroupComm, ThreadMesh
from .commands import (
    LORA_LOAD,
    LORA_UNLOAD,
    Cmd,
    RankState,
    decode,
    empty_batch,
    encode,
    lora_command_ints,
    lora_step_ints,
    profile_model,
    swap_ints,
)
from .kv_offload import allocate_ints, copy_ints

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a collective not done by then means a rank hung
STARTUP_TIMEOUT_S = 300.0  # workers loading their shards
CONTROL_TIMEOUT_S = 7 * 86400.0  # a worker waits for the next step as long as the server idles


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise KilnRuntimeError(f"${name} must be a number of seconds, got {os.environ[name]!r}") from None


class MeshExecutor:
    """What both mesh executors share: rank 0's runner, step planning (and the data-parallel split), the commands
    and the failure state. Subclasses start the other ranks (`_start`) and hand them each command (`_send` before
    rank 0 runs its part, `_join` after)."""

    graph_runner = None  # decode steps run eagerly: CUDA graphs would have to capture the collectives
    _lora: LoRAManager | None = None

    def __init__(self, artifact: LoadedArtifact) -> None:
        self.artifact = artifact
        par = artifact.manifest["parallel"]
        self.world_size = int(par["world_size"])
        self.data_parallel = par["attention"] == "dp"
        self.timeout = _env_float("KILN_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)
        self.failure: str | None = None
        self.states: list[RankState] = []
        self.num_blocks = 0
        self.num_swap_blocks = 0
        self.memory_plan: dict[str, Any] = {}
        self._draft_methods = sorted((artifact.manifest.get("drafts") or {}).values(), key=lambda d: d["method"])
        # data-parallel attention: which rank runs each sequence, and which rank's pool holds each block's KV
        self._rank_of: dict[int, tuple[int, Any]] = {}  # seq_id -> (rank, seq)
        self._block_owner: dict[int, int] = {}
        self._swap_owner: dict[int, int] = {}
        self._steps = 0
        self._failure_callbacks: list = []
        self._offload_saves: list[int] | None = None  # the offload tier's (device block, host slot) copies to send

    def on_failure(self, callback) -> None:
        """`callback(reason)` once the mesh fails (from the thread that saw it: a step's, or the rank monitor's)."""
        self._failure_callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    # ------------------------------------------------------------ lifecycle
    def allocate(self, sched: SchedulerConfig, *, num_kv_blocks: int | None, kv_cache_bytes: int | None,
                 proposer: Any = None) -> None:
        """Sizes the KV pool (rank 0's plan: every rank holds the same blocks) and allocates it on every rank."""
        art = self.artifact
        kv = art.kv_cache_config
        lengths = profile_lengths(sched.max_batched_tokens, sched.chunked_prefill, art.model_config.max_model_len,
                                  sched.max_seqs)
        plan = plan_memory(kv, art.device, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                           memory_fraction=float(art.manifest["kv_cache"].get("memory_fraction", 0.9)),
                           model=_ProfileModel(self), prefill_lengths=lengths, vocab_size=art.model_config.vocab_size,
                           proposer=proposer)
        logger.info(describe_memory_plan(plan, kv.block_size) + f" on each of {self.world_size} ranks")
        self.memory_plan = plan
        self.num_blocks = plan["kv_blocks"]
        self.num_swap_blocks = sched.swap_space // kv.bytes_per_block if sched.preemption == "swap" else 0
        self._step(Cmd.ALLOCATE, [self.num_blocks, self.num_swap_blocks])
        self.runner = self.states[0].runner

    def shutdown(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("parallel executor failed: %s", reason)
            for callback in self._failure_callbacks:
                callback(reason)

    def _check(self) -> None:
        if self.failure is not None:
            raise ExecutorError(f"the model's ranks cannot run: {self.failure}")

    # ------------------------------------------------------------ one command on every rank
    def _send(self, cmd: Cmd, ints: list[int], batches: list[HostBatch]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _join(self, rank0_error: BaseException | None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _step(self, cmd: Cmd, ints: list[int] = (), batches: list[HostBatch] = ()) -> Any:
        self._check()
        if self._offload_saves and cmd is not Cmd.KV_OFFLOAD:  # before anything can overwrite the evicted blocks
            self._step(Cmd.KV_OFFLOAD, copy_ints(self._take_offload_saves(), []))
        ints, batches = list(ints), list(batches)
        try:
            self._send(cmd, ints, batches)
            try:
                out = self.states[0].handle(cmd, ints, batches)
            except BaseException as e:
                self._join(e)
                raise
            self._join(None)
            return out
        except CommError as e:
            self._fail(str(e))
            raise ExecutorError(f"the model's ranks cannot run: {e}") from None

    # ------------------------------------------------------------ LoRA adapters
    @property
    def lora(self) -> LoRAManager | None:
        return self._lora

    @lora.setter
    def lora(self, manager: LoRAManager | None) -> None:
        """The engine's adapter manager (rank 0's slices): it plans every step's slots, and its loads and unloads
        reach the other ranks as LORA commands (each rank reads its own slice), between steps."""
        if manager is not None and self.data_parallel:
            raise KilnRuntimeError("LoRA adapters with data-parallel attention are not supported")
        self._lora = manager
        self.states[0].lora = manager
        if manager is not None:
            manager.listeners.append(self._lora_changed)

    def _lora_changed(self, kind: str, adapter: Adapter) -> None:
        if kind == "unload":
            self._step(Cmd.LORA, lora_command_ints(LORA_UNLOAD, adapter.lora_id))
            return
        failed = self._step(Cmd.LORA, lora_command_ints(LORA_LOAD, adapter.lora_id, adapter.name, adapter.path))
        if failed:
            raise LoRAError(f"adapter {adapter.name!r}: {failed} of the {self.world_size - 1} other ranks could not "
                            f"read {adapter.path} (every rank reads the adapter's files itself; see their logs)")

    def _lora_ints(self, batch: ScheduledBatch, host: HostBatch) -> list[int]:
        """The step's adapter ids and slots (rank 0's manager plans them) for the EXECUTE command."""
        if self._lora is None:
            return []
        starts = host.query_start_loc
        ids = [seq.lora_id for seq in batch.seqs]
        slots = self._lora.assign([(i, starts[k], starts[k + 1] - starts[k]) for k, i in enumerate(ids)])
        return lora_step_ints(ids, slots)

    # ------------------------------------------------------------ the CPU offload tier (worker/distributed/kv_offload.py)
    def attach_offload(self, num_blocks: int) -> None:
        """Every rank allocates `num_blocks` host slots of its slice of a block."""
        assert not self.data_parallel, "a data-parallel mesh's blocks live on one rank each"
        failed = self._step(Cmd.KV_OFFLOAD, allocate_ints(num_blocks))
        if failed:
            raise ArtifactError(f"kv_cache.offload: {failed} of the {self.world_size} ranks could not allocate "
                                f"{num_blocks} host blocks (see their logs)")
        self._offload_saves = []

    def queue_offload_save(self, block_id: int, slot: int) -> None:
        """Every rank copies `block_id` into host `slot` ahead of the next command (the prefix cache evicted it
        while rank 0 scheduled: nothing writes into it before a command)."""
        self._offload_saves += [block_id, slot]

    def offload_restore(self, slots: list[int], blocks: list[int]) -> list[tuple[bytes, bytes | None]]:
        """Every rank runs the queued saves, then copies each host slot into its block; per block, the digest of
        every rank's slice as saved and as copied (None: a rank's copy failed)."""
        return self._step(Cmd.KV_OFFLOAD, copy_ints(self._take_offload_saves(), list(zip(slots, blocks, strict=True))))

    def _take_offload_saves(self) -> list[int]:
        saves, self._offload_saves = self._offload_saves, []
        return saves

    # ------------------------------------------------------------ the Executor interface
    def swap(self, batch: ScheduledBatch) -> None:
        if not (batch.swap_out or batch.swap_in):
            return
        for dev, cpu in batch.swap_out:
            if dev in self._block_owner:
                self._swap_owner[cpu] = self._block_owner[dev]
        for cpu, dev in batch.swap_in:
            if cpu in self._swap_owner:
                self._block_owner[dev] = self._swap_owner[cpu]
        self._step(Cmd.SWAP, swap_ints(batch))

    def execute(self, batch: ScheduledBatch, input_patch: tuple[list[int], list[int], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, LogitsLayout]:
        self._check()
        self.swap(batch)
        batches, layout = self._plan(batch, input_patch)
        ints = [0, self._candidates(batch, layout), *self._lora_ints(batch, batches[0])]
        return self._step(Cmd.EXECUTE, ints, batches), layout

    def execute_with_hidden(self, batch: ScheduledBatch, aux_layers: tuple[int, ...] = ()
                            ) -> tuple[torch.Tensor, LogitsLayout, DraftInput]:
        # the EAGLE-3 proposer refuses a parallel artifact when it is built (core/speculative/eagle.py)
        assert not aux_layers, "auxiliary hidden states (EAGLE-3) are not gathered from a mesh's ranks"
        self._check()
        self.swap(batch)
        batches, layout = self._plan(batch, None)
        logits = self._step(Cmd.EXECUTE, [1, self._candidates(batch, layout), *self._lora_ints(batch, batches[0])],
                            batches)
        return logits, layout, self.states[0].draft

    def propose(self, method: str, draft: DraftInput, input_ids: list[int], rows: list[int]) -> list[int]:
        index = next(k for k, d in enumerate(self._draft_methods) if d["method"] == method)
        logits = self._step(Cmd.PROPOSE, [index, len(input_ids), *input_ids, *rows])
        return logits.argmax(dim=-1).tolist()

    # ------------------------------------------------------------ planning a step
    def _candidates(self, batch: ScheduledBatch, layout: LogitsLayout) -> int:
        """The logits each row needs (ForwardBatch.logit_candidates): with a vocab-parallel LM head, a step whose
        rows are all greedy or top-k gets only each row's top k from the ranks (gather_logits)."""
        return 0 if self.data_parallel else logit_candidates(batch.seqs, layout)

    def _plan(self, batch: ScheduledBatch, input_patch) -> tuple[list[HostBatch], LogitsLayout]:
        runner = self.states[0].runner
        patch = None
        if input_patch is not None:  # the previous step's tokens, still on the device: read them now
            dst, src, tokens = input_patch
            values = tokens.tolist()
            patch = {d: values[s] for d, s in zip(dst, src, strict=True)}
        if not self.data_parallel:
            host, layout = runner.plan(batch)
            for row, token in (patch or {}).items():  # decodes come first: batch row = input row
                host.input_ids[row] = token
            return [host], layout
        return self._plan_data_parallel(batch, patch or {})

    def _plan_data_parallel(self, batch: ScheduledBatch, patch: dict[int, int]) -> tuple[list[HostBatch], LogitsLayout]:
        """Each sequence on its rank (where its KV is); each rank's sub-batch planned alone, decodes first; the
        logits come back gathered in rank order, so the layout's rows are shifted by the ranks before."""
        ranks = self._assign(batch)
        members: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, r in enumerate(ranks):
            members[r].append(i)
        runner = self.states[0].runner
        hosts: list[HostBatch | None] = []
        layouts: list[LogitsLayout | None] = []
        for idx in members:
            if not idx:
                hosts.append(None)
                layouts.append(None)
                continue
            sub = ScheduledBatch(seqs=[batch.seqs[i] for i in idx], num_new_tokens=[batch.num_new_tokens[i] for i in idx],
                                 num_decodes=sum(1 for i in idx if i < batch.num_decodes))
            host, layout = runner.plan(sub)
            for j, i in enumerate(idx):
                if i in patch:
                    host.input_ids[j] = patch[i]
            hosts.append(host)
            layouts.append(layout)
        tokens = [len(h.input_ids) if h else 0 for h in hosts]
        rows = [len(h.logits_indices) if h else 0 for h in hosts]
        batches = []
        for h in hosts:
            if h is None:
                batches.append(empty_batch(tokens, rows))
            else:
                h.dp_num_tokens, h.dp_num_rows = tokens, rows
                batches.append(h)
        sample_rows: list[int | None] = [None] * len(batch.seqs)
        prompt_rows: list[tuple[int, int, int] | None] = [None] * len(batch.seqs)
        for r, idx in enumerate(members):
            base = sum(rows[:r])
            for j, i in enumerate(idx):
                s, p = layouts[r].sample_rows[j], layouts[r].prompt_rows[j]
                sample_rows[i] = None if s is None else base + s
                prompt_rows[i] = None if p is None else (base + p[0], p[1], p[2])
        return batches, LogitsLayout(sample_rows=sample_rows, prompt_rows=prompt_rows)

    def _assign(self, batch: ScheduledBatch) -> list[int]:
        """The rank of each sequence: where the KV of its computed tokens is (the owner of the block holding its
        last computed token), else — a sequence starting from its first token — the rank running the fewest."""
        self._steps += 1
        if self._steps % 64 == 0:  # forget finished sequences
            self._rank_of = {k: v for k, v in self._rank_of.items() if v[1].status is not SequenceStatus.FINISHED}
        load = [0] * self.world_size
        for r, seq in self._rank_of.values():
            if seq.status is SequenceStatus.RUNNING:
                load[r] += 1
        bs = self.states[0].runner.block_size
        out = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            computed = seq.num_computed_tokens
            rank = None
            if computed > 0:
                rank = self._block_owner.get(seq.block_table[(computed - 1) // bs])
                assert rank is not None, f"seq {seq.seq_id}: no rank holds the KV of its first {computed} tokens"
            elif seq.seq_id in self._rank_of:
                rank = self._rank_of[seq.seq_id][0]
            if rank is None:
                rank = min(range(self.world_size), key=lambda r: (load[r], r))
                load[rank] += 1
            self._rank_of[seq.seq_id] = (rank, seq)
            for b in seq.block_table[computed // bs:(computed + n - 1) // bs + 1]:
                self._block_owner[b] = rank
            out.append(rank)
        return out


class _ProfileModel:
    """What `plan_memory` profiles on CUDA: one prefill through every rank at once (their collectives pair up)."""

    def __init__(self, executor: MeshExecutor) -> None:
        self.executor = executor

    def forward(self, fb, caches):
        ex = self.executor
        ex._send(Cmd.PROFILE, fb.seq_lens.tolist(), [])
        try:
            out = profile_model(ex.states[0].artifact).forward(fb, caches)
        except BaseException as e:
            ex._join(e)
            raise
        ex._join(None)
        return out


# ---------------------------------------------------------------- worker processes


class ProcessMeshExecutor(MeshExecutor):
    """Rank 0 here; ranks 1..n-1 as worker processes on this host (spawned), or on others (a torchrun-style launch:
    WORLD_SIZE / RANK / MASTER_ADDR / MASTER_PORT set, RANK=0 here). One TCPStore rendezvous; each worker loads its
    own shards and says so in the store before the process groups form, so a worker that cannot load fails the
    start with its message, not a timeout."""

    def __init__(self, artifact: LoadedArtifact) -> None:
        super().__init__(artifact)
        self.procs: dict[int, subprocess.Popen] = {}
        self.store = None
        self.comm: ProcessGroupComm | None = None
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        import torch.distributed as dist

        art, world = self.artifact, self.world_size
        external = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        if external:
            if int(os.environ["WORLD_SIZE"]) != world or int(os.environ["RANK"]) != 0:
                raise KilnRuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} RANK={os.environ['RANK']}: this "
                                       f"artifact has {world} ranks and the engine runs rank 0")
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
            listen_fd = None
        else:  # TCPStore's server listens on every interface whatever `host` says: the local ranks' store gets
            host, (listen_fd, port) = "127.0.0.1", _loopback_listener()  # a socket bound to loopback instead
        startup = _env_float("KILN_DIST_STARTUP_TIMEOUT", STARTUP_TIMEOUT_S)
        import datetime

        # torchrun's agent may host the store itself (TORCHELASTIC_USE_AGENT_STORE): then every rank is its client
        agent_store = external and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self.store = dist.TCPStore(host, port, world, not agent_store, datetime.timedelta(seconds=startup),
                                   wait_for_workers=False, master_listen_fd=listen_fd)
        if not external:
            for rank in range(1, world):
                self.procs[rank] = self._spawn(rank, self.store.port)
        self._wait_loaded(startup)
        # rank 0 only sends commands: a send a worker does not take within the timeout means that worker hung
        self.comm = ProcessGroupComm(0, world, self.store, art.device, timeout=self.timeout,
                                     control_timeout=self.timeout)
        self.states = [RankState(art, self.comm)]
        if self.procs:
            self._monitor = threading.Thread(target=self._watch, name="kiln-rank-monitor", daemon=True)
            self._monitor.start()

    def _spawn(self, rank: int, port: int) -> subprocess.Popen:
        art = self.artifact
        threads = os.environ.get("KILN_WORKER_THREADS") or str(max(1, torch.get_num_threads() // self.world_size))
        device = art.device if art.device.type != "cuda" else torch.device("cuda", rank)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "KILN_DIST_DEVICE": str(device),
               "KILN_PARENT_PID": str(os.getpid()), "KILN_WORKER_THREADS": threads,
               "KILN_DIST_TIMEOUT": str(self.timeout), "OMP_NUM_THREADS": threads, "TVM_NUM_THREADS": threads}
        return subprocess.Popen([sys.executable, "-m", "kiln.runtime.worker.distributed.worker", str(art.path)], env=env)

    def _wait_loaded(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.world_size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    raise ArtifactError(f"rank {rank} could not start: {self.store.get(f'error/{rank}').decode()}")
                if self.store.check([f"loaded/{rank}"]):
                    pending.discard(rank)
                    continue
                proc = self.procs.get(rank)
                if proc is not None and proc.poll() is not None:
                    raise KilnRuntimeError(f"rank {rank}'s worker exited with status {proc.returncode} while loading "
                                           f"{self.artifact.path}")
            if pending and time.monotonic() > deadline:
                raise KilnRuntimeError(f"ranks {sorted(pending)} did not load {self.artifact.path} within {timeout:g} s "
                                       "($KILN_DIST_STARTUP_TIMEOUT)")
            if pending:
                time.sleep(0.02)

    def _watch(self) -> None:
        """A worker that exits while the mesh runs fails it now (the next step, or the one in flight, raises)."""
        while not self._stopping.is_set():
            for rank, proc in self.procs.items():
                if proc.poll() is not None and not self._stopping.is_set():
                    self._fail(f"rank {rank}'s worker (pid {proc.pid}) exited with status {proc.returncode}")
                    return
            self._stopping.wait(0.1)

    def _send(self, cmd: Cmd, ints: list[int], batches: list[HostBatch]) -> None:
        self.comm.broadcast_command(encode(cmd, ints, batches))

    def _join(self, rank0_error: BaseException | None) -> None:
        pass  # the workers run in their own processes; their collectives are rank 0's waits

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the workers (a STOP command, then SIGKILL for any still running after `timeout`) and reaps them."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.comm is not None and self.failure is None:
            try:
                self._send(Cmd.STOP, [], [])
            except Exception:  # the mesh is already broken: the workers are killed below
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.comm is not None:
            self.comm.close()  # rank 0's state holds the comm too: its groups go now, not at interpreter exit
        self.comm = None
        self.store = None


def worker_loop(state: RankState, comm: ProcessGroupComm) -> int:
    """A worker's life: run rank 0's commands until STOP (0) or until the mesh breaks (3). A step that fails here
    as it fails on rank 0 (a request the model cannot run) is logged and the next command awaited: rank 0
    isolates the request and goes on; a failure of this rank alone leaves rank 0 waiting until its timeout."""
    while True:
        try:
            cmd, ints, batches = decode(comm.broadcast_command(None))
        except CommError as e:
            logger.error("rank %d: lost rank 0 (%s); exiting", comm.rank, e)
            return 3
        if cmd is Cmd.STOP:
            return 0
        try:
            state.handle(cmd, ints, batches)
        except CommError as e:
            logger.error("rank %d: %s; exiting", comm.rank, e)
            return 3
        except Exception as e:  # the same failure rank 0 isolates
            logger.warning("rank %d: step failed: %s: %s", comm.rank, type(e).__name__, e)


# ---------------------------------------------------------------- the single-process mesh


class LocalMeshExecutor(MeshExecutor):
    """Every rank in this process: rank r's model built from weights/rank{r}/ on the engine's device, run by its
    own thread; collectives meet in a ThreadMesh (a barrier, and the reduction on the shared device)."""

    def start(self) -> None:
        art = self.artifact
        self.mesh = ThreadMesh(self.world_size, self.timeout)
        arts = [art] + [load_artifact(art.path, art.device, load_tokenizer=False, rank=r)
                        for r in range(1, self.world_size)]
        self.states = [RankState(a, self.mesh.comm(r)) for r, a in enumerate(arts)]
        self.pool = ThreadPoolExecutor(max_workers=self.world_size - 1, thread_name_prefix="kiln-rank")
        self._futures: list[Future] = []

    def _send(self, cmd: Cmd, ints: list[int], batches: list[HostBatch]) -> None:
        def run(state: RankState) -> None:
            try:
                state.handle(cmd, ints, batches)
            except BaseException:
                self.mesh.abort()  # the ranks waiting for this one raise now
                raise

        self._futures = [self.pool.submit(run, s) for s in self.states[1:]]

    def _join(self, rank0_error: BaseException | None) -> None:
        """Waits for the other ranks' part. A rank that failed aborted the mesh, so the others stopped at their next
        collective (CommError); the failure to report is the first that is not such a consequence. Only a
        collective that timed out with no such cause is the mesh's own failure (CommError, fatal)."""
        if rank0_error is not None:
            self.mesh.abort()
        errors = []
        for f in self._futures:
            try:
                f.result(timeout=self.timeout + 5)
            except BaseException as e:  # noqa: PERF203
                errors.append(e)
        self._futures = []
        if rank0_error is None and not errors:
            return
        self.mesh.reset()
        root = next((e for e in [rank0_error, *errors] if e is not None and not isinstance(e, CommError)), None)
        if root is not None and root is not rank0_error:
            raise root
        if rank0_error is None:
            raise errors[0]

    def shutdown(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def create_mesh_executor(artifact: LoadedArtifact, sched: SchedulerConfig, *, num_kv_blocks: int | None = None,
                         kv_cache_bytes: int | None = None, backend: str | None = None,
                         proposer: Any = None) -> MeshExecutor:
    backend = backend or os.environ.get("KILN_EXECUTOR", "mp")
    if backend not in ("mp", "local"):
        raise KilnRuntimeError(f"unknown executor backend {backend!r} (known: mp, local)")
    executor = LocalMeshExecutor(artifact) if backend == "local" else ProcessMeshExecutor(artifact)
    try:
        executor.start()
        executor.allocate(sched, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes, proposer=proposer)
    except BaseException:
        executor.shutdown()
        raise
    import weakref

    weakref.finalize(executor, _shutdown_quietly, executor.shutdown)
    return executor


def _shutdown_quietly(stop) -> None:
    try:
        stop()
    except Exception:  # at interpreter exit, best effort
        pass


def _loopback_listener() -> tuple[int, int]:
    """(file descriptor, port) of a TCP socket listening on 127.0.0.1, the descriptor the caller's from now on."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return sock.detach(), port
