"""The two roles an engine core plays in a disaggregated deployment, attached to an `EngineCore`:

* `DecodeRole`: `add_request(..., transfer_id)` queues a request whose prompt K/V (all but the last token) is
  to come from a prefill core. It matches the prefix cache, leases the blocks of `[prefix_hit, L-1)` and
  returns their descriptor (`RemotePrefill`) for the prefill core, or None when the request is better prefilled
  here (the reason is counted: one decision per request). `poll()` takes the frames that arrived, writes those that check out, commits
  complete transfers (the sequence then computes token L-1 itself and samples, like any prefill's last chunk)
  and sends a request whose transfer failed, was refused or outlived its lease back to a local prefill (counted in
  `fallbacks`, by the lease's state; the request's decision stays "remote"). What is not a frame (garbage, several
  parts), or is one for a transfer never leased here, is dropped, counted (`num_bad_frames`, `dropped` by kind)
  and logged; no frame stops the core.
* `PrefillRole`: `add(request_id, prompt, descriptor)` prefills `prompt[:L-1]` (its own prefix cache may cover
  the front), snapshots the K/V of the leased range the moment that prefill is done and pushes it (one frame per
  block with its digest, then `Done`) from a sender thread; its blocks are free again at once. A request that
  ends any other way sends `Fail`.

Sampling happens on the decode core only, so its state (seeds, logprobs, stop checks) never crosses the wire.
"""
from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from ..core.batch import cdiv
from ..core.lease import LeaseState, TransferLedger
from ..core.sequence import Sequence, SequenceStatus
from ..droplog import DropLog
from ..sampling_params import SamplingParams
from .transport import (
    TRANSFER_BUCKETS,
    BlockFrame,
    DisaggError,
    DoneFrame,
    FailFrame,
    KVLayout,
    RemotePrefill,
    Transport,
    TransportClosed,
    block_digest,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

def _local_reason(seq: Sequence, num_requests_seqs: int) -> str | None:
    if num_requests_seqs != 1:
        return "n_gt_1"
    if seq.status is SequenceStatus.PENDING:  # its grammar is compiling (constrained.py queues it when done)
        return "grammar_compiling"
    if seq.want_prompt_logprobs:
        return "prompt_logprobs"
    return None


class DecodeRole:
    def __init__(self, engine, receiver: Transport, *, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, endpoint: str | None = None) -> None:
        self.engine = engine
        self.receiver = receiver
        self.endpoint = endpoint
        self.layout = KVLayout.of(engine)
        self.ledger = TransferLedger(engine.block_manager, lease_s, clock)
        self.pending: dict[str, Sequence] = {}  # transfer id -> its sequence (status REMOTE)
        self._transfer_of: dict[int, str] = {}  # seq id -> transfer id
        self.decisions: Counter[str] = Counter()  # one per request: "remote" or "local:<reason>"
        self.fallbacks: Counter[str] = Counter()  # "remote" ones prefilled here after all, by lease state
        self.num_bad_frames = 0
        # what the receiver drops (logged once a kind, then once a minute): not a frame, or one for no transfer leased
        self.dropped = receiver.dropped = DropLog(logger=logger)
        self.bytes_received = 0
        self.uncached = 0  # prompt tokens past the prefix-cache hit of the latest add_request
        self.last_decision = ""  # and its decision: "remote" or "local:<reason>"
        self.transfer_counts = [0] * (len(TRANSFER_BUCKETS) + 1)  # committed transfers per TRANSFER_BUCKETS bin
        self.transfer_seconds = 0.0
        engine.scheduler.on_finish = self._on_finish

    # Admission --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None,
                    transfer_id: str, *, priority: int = 0, min_remote_tokens: int = 0,
                    local_reason: str | None = None, short_reason: str = "short_prompt") -> RemotePrefill | None:
        """Queues the request; returns the leased destination for a remote prefill, or None to prefill it here:
        `local_reason` (the router decided: e.g. its prefill queue is full), or fewer than `min_remote_tokens`
        prompt tokens left to compute past this core's prefix-cache hit (conditional disaggregation: the reason
        is then `short_reason`), or a reason of the request's own. `self.last_decision` and `self.uncached` (the prompt tokens past the hit) then
        describe it."""
        engine = self.engine
        engine.add_request(request_id, prompt_token_ids, params, priority=priority)
        seqs = engine.requests[request_id].seqs
        seq = seqs[0]
        reason = local_reason or _local_reason(seq, len(seqs))
        bm = engine.block_manager
        hits: list[int] = []
        self.uncached = seq.num_tokens
        if reason is None:
            hits = bm.get_computed_blocks(seq)
            need = cdiv(seq.num_tokens - 1, bm.block_size) - len(hits)
            self.uncached = seq.num_tokens - len(hits) * bm.block_size
            if need <= 0:
                reason = "nothing_to_transfer"
            elif self.uncached - 1 < min_remote_tokens:
                reason = short_reason
        if reason is None:
            lease = self.ledger.reserve(transfer_id, need, hits)
            if lease is None:
                reason = "no_free_blocks"
        if reason is not None:
            self.last_decision = "local:" + reason
            self.decisions[self.last_decision] += 1
            return None
        engine.scheduler.waiting.remove(seq)
        seq.status = SequenceStatus.REMOTE
        seq.num_cached_tokens = len(hits) * bm.block_size
        self.pending[transfer_id] = seq
        self._transfer_of[seq.seq_id] = transfer_id
        self.last_decision = "remote"
        self.decisions["remote"] += 1
        return RemotePrefill(transfer_id, seq.num_tokens, len(hits), lease.blocks, lease.generations, self.layout,
                             self.endpoint)

    def abort(self, transfer_id: str) -> None:
        """Idempotent: ends the transfer's lease; its request falls back to a local prefill (a request the
        client aborted is ended by the engine's abort_request, which ends the lease too)."""
        self.ledger.abort(transfer_id)
        self._settle()

    def fail(self, transfer_ids: list[str]) -> None:
        """The prefill side is gone (or gave up): these transfers fall back to a local prefill now."""
        for t in transfer_ids:
            self.ledger.fail(t)
        self._settle()

    # Frames -----------------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> int:
        """Handles the frames that arrived (waiting up to `timeout` for the first), expires leases and settles
        finished transfers. Returns the number of frames."""
        frames = self.receiver.recv(timeout) if self.pending or timeout else self.receiver.recv(0.0)
        for raw in frames:
            try:
                self._on_frame(raw)
            except Exception as e:  # a frame nothing in _on_frame foresaw: dropped, the core keeps serving
                logger.debug("a KV frame failed", exc_info=True)
                self.num_bad_frames += 1
                self.dropped("failed", "a KV frame that failed: %s: %s", type(e).__name__, e)
        self.ledger.expire()
        self._settle()
        return len(frames)

    def _on_frame(self, raw: bytes) -> None:
        frame = decode(raw)
        if frame is None:
            self.num_bad_frames += 1
            self.dropped("decode", "a KV frame of %d bytes that does not decode", len(raw))
            return
        tid = frame.transfer_id
        if self.ledger.state(tid) is None:  # never leased here (not a late frame of an ended transfer)
            self.num_bad_frames += 1
            self.dropped("unknown", "a %s frame for transfer %.80r, which this core did not lease",
                         type(frame).__name__, tid)
            return
        if isinstance(frame, BlockFrame):
            if len(frame.payload) != self.layout.block_bytes or \
                    block_digest(tid, frame.index, frame.generation, frame.payload) != frame.digest:
                self.num_bad_frames += 1  # corrupted in transit: the transfer cannot complete as sent
                self.ledger.fail(tid)
                return
            if not self.ledger.begin_write(tid, frame.index, frame.block_id, frame.generation):
                self.num_bad_frames += 1  # late, duplicate in flight, stale generation or foreign block
                return
            written = None
            try:
                self._write(frame.block_id, frame.payload)
                written = frame.digest
                self.bytes_received += len(frame.payload)
            finally:
                self.ledger.end_write(tid, frame.index, written)
        elif isinstance(frame, DoneFrame):
            self.ledger.expect(tid, frame.digests)
        elif isinstance(frame, FailFrame):
            self.ledger.fail(tid)

    def _write(self, block_id: int, payload: bytes) -> None:
        layout = self.layout
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(layout.torch_dtype)
        data = data.view(layout.num_layers, *layout.block_shape)
        for layer, cache in enumerate(self.engine.runner.kv_caches):
            cache[block_id].copy_(data[layer])

    def _settle(self) -> None:
        """Commits complete transfers; sends the requests of ended ones back to a local prefill."""
        engine, bm = self.engine, self.engine.block_manager
        for tid, seq in list(self.pending.items()):
            lease = self.ledger.commit(tid)
            if lease is not None:
                seconds = self.ledger.clock() - (lease.deadline - self.ledger.lease_s)
                self.transfer_counts[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1
                self.transfer_seconds += seconds
                seq.block_table = lease.hit_blocks + lease.blocks
                seq.num_registered_blocks = len(lease.hit_blocks)
                seq.num_computed_tokens = seq.num_tokens - 1
                bm.register_full_blocks(seq)
            else:
                state = self.ledger.state(tid)
                if state is LeaseState.RESERVED:
                    continue
                self.fallbacks[state.value if state else "unknown"] += 1
            del self.pending[tid]
            del self._transfer_of[seq.seq_id]
            engine.scheduler.add(seq)  # with its blocks: one token left to compute; without: a local prefill

    def _on_finish(self, seq: Sequence) -> None:
        tid = self._transfer_of.pop(seq.seq_id, None)
        if tid is not None:
            self.pending.pop(tid, None)
            self.ledger.abort(tid)

    def check(self) -> dict[str, int]:
        """The block accounting (free + active + leased + cached == total); returns the states."""
        self.ledger.check()
        return self.ledger.block_states()


class PrefillRole:
    """`connect(endpoint)` gives the sending transport for a descriptor's endpoint (cached per endpoint).
    `threaded=False` sends from the engine's loop (deterministic tests)."""

    def __init__(self, engine, connect: Callable[[str | None], Transport], *, threaded: bool = True) -> None:
        self.engine = engine
        self.layout = KVLayout.of(engine)
        self._connect = connect
        self._transports: dict[str | None, Transport] = {}
        self.jobs: dict[str, RemotePrefill] = {}  # engine request id -> descriptor
        self.counts: Counter[str] = Counter()
        self.bytes_sent = 0
        self._queue: queue.Queue | None = None
        if threaded:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._sender, name="kiln-kv-sender", daemon=True)
            self._thread.start()
        engine.scheduler.on_finish = self._on_finish

    def add(self, request_id: str, prompt_token_ids: list[int], desc: RemotePrefill) -> None:
        desc.layout.check_pairs_with(self.layout)
        if desc.prompt_len != len(prompt_token_ids) or desc.prompt_len < 2:
            raise DisaggError(f"descriptor for {desc.prompt_len} prompt tokens, prompt has {len(prompt_token_ids)}")
        if cdiv(desc.prompt_len - 1, self.layout.block_size) != desc.first_block + len(desc.block_ids):
            raise DisaggError("the descriptor's blocks do not cover the prompt but its last token")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, list(prompt_token_ids[:-1]), params)
        self.jobs[request_id] = desc

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)  # idempotent; sends Fail through _on_finish

    def _on_finish(self, seq: Sequence) -> None:
        desc = self.jobs.pop(seq.request_id, None)
        if desc is None:
            return
        if seq.finish_reason == "length" and seq.num_computed_tokens == desc.prompt_len - 1:
            ids = seq.block_table[desc.first_block:desc.first_block + len(desc.block_ids)]
            index = torch.tensor(ids, dtype=torch.int64, device=self.engine.runner.kv_caches[0].device)
            snapshot = torch.stack([cache.index_select(0, index) for cache in self.engine.runner.kv_caches], 1)
            job = (desc, snapshot.to("cpu").contiguous())
            self.counts["sent"] += 1
        else:
            job = (desc, None)
            self.counts["failed"] += 1
        if self._queue is not None:
            self._queue.put(job)
        else:
            self._send(*job)

    def _sender(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._send(*job)
            except Exception:  # never the thread: the decode side's lease expires and it prefills itself
                logger.exception("sending transfer %s failed", job[0].transfer_id)
            finally:
                self._queue.task_done()

    def _send(self, desc: RemotePrefill, snapshot: torch.Tensor | None) -> None:
        tid = desc.transfer_id
        transport = self._transports.get(desc.endpoint)
        if transport is None:
            transport = self._transports[desc.endpoint] = self._connect(desc.endpoint)
        try:
            if snapshot is None:
                transport.send(encode(FailFrame(tid, "the prefill request ended before its prefill")))
                return
            raw = snapshot.view(torch.uint8).view(len(desc.block_ids), -1)
            digests = []
            for i, (block, gen) in enumerate(zip(desc.block_ids, desc.generations, strict=True)):
                payload = raw[i].numpy().tobytes()
                digest = block_digest(tid, i, gen, payload)
                digests.append(digest)
                transport.send(encode(BlockFrame(tid, i, block, gen, digest, payload)))
                self.bytes_sent += len(payload)
            transport.send(encode(DoneFrame(tid, digests)))
        except TransportClosed as error:
            self.counts["transport_closed"] += 1
            self._transports.pop(desc.endpoint).close()  # the next transfer connects afresh
            logger.warning("transfer %s: %s", tid, error)

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until every queued transfer was sent (tests)."""
        if self._queue is None:
            return
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
        for t in self._transports.values():
            t.close()
