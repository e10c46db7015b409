"""The engine-core process: an EngineCore served over the engine-core protocol (ipc/protocol.py) on pyzmq.

`python -m kiln.runtime.core.process --config JSON --ready-fd N` (started by ipc/client.py: CoreProcess): loads
the artifact, writes `Ready` (or `StartupFailed`) to the pipe `N`, then loops: take every message waiting
(blocking only while idle), step the engine, send each client the step's deltas for its requests. Request ids
are namespaced per client (`client␟id`), so several API servers can share one core; each client's outputs go
to its own PUSH socket. A heartbeat thread tells every client the core is alive (and how far it got) every
`heartbeat_interval`; a client silent for `client_timeout` is dropped and its requests aborted. A message that
is malformed (not two frames, a client without a name of its own, a payload that does not decode, a `Hello` whose
output address is no endpoint) or from a client that did not say `Hello` is dropped and logged (DropLog: once per
kind, then at most once a minute; droplog.py); nothing a client sends stops the loop. A utility whose work would hold
the loop (an adapter's file reads) returns a `Deferred` (deferred.py): the loop goes on stepping and answers the
call once that work, on a thread, is done. The input socket refuses a second
connection under a name in use (no ROUTER_HANDOVER), so no one takes a live client's name. The process
dies with its parent (PR_SET_PDEATHSIG, and a parent check on every heartbeat) and ignores SIGINT: the API
server that owns it decides when it stops.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from .. import threads
from ..deferred import Deferred
from ..droplog import DropLog
from ..embedding import embedding_section
from ..errors import KilnRuntimeError, RequestError
from ..ipc import curve
from ..ipc.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequests,
    AddResult,
    CoreConfig,
    CoreInfo,
    CoreStats,
    Goodbye,
    Heartbeat,
    Hello,
    Ready,
    SeqDelta,
    StartupFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    Welcome,
    core_decoder,
    decode_params,
    encode,
)
from ..worker.interface import ExecutorError
from ..worker.lora_loads import LORA_UTILITIES
from .sequence import SequenceStatus
from .stats import KV_BLOCK_FIELDS

logger = logging.getLogger("kiln.core")

WAITING = SequenceStatus.WAITING
SEP = "\x1f"  # between a client's name and its request id in the engine's request ids


def _merged(held: SeqDelta, new: SeqDelta) -> SeqDelta:
    """`held` followed by `new`, as one delta of the same completion (per-token lists concatenated)."""
    def cat(a: list | None, b: list | None) -> list | None:
        return b if a is None else a if b is None else a + b

    return SeqDelta(new.request_id, new.index, held.token_ids + new.token_ids, cat(held.logprobs, new.logprobs),
                    cat(held.prompt_logprobs, new.prompt_logprobs), new.finish_reason, new.stop_reason, new.error)


class StreamCoalescer:
    """Holds back each completion's new tokens until `interval` of them are waiting, so that a client (the API
    server, and behind it each HTTP stream) wakes up once per `interval` tokens of a stream instead of once per
    step. A completion's first tokens, its end (finish, error) and anything with prompt logprobs go out at once;
    held tokens are merged in order into the next delta sent. `forget` drops what is held for ended requests
    (aborted: nothing more is sent for them). interval 1 passes every delta through unchanged."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval {interval}: give at least 1")
        self.interval = interval
        # engine request id -> completion index -> its held delta (None: its first tokens went out, none held)
        self.streams: dict[str, dict[int, SeqDelta | None]] = {}

    def __call__(self, deltas: list[SeqDelta]) -> list[SeqDelta]:
        if self.interval == 1:
            return deltas
        out, streams, interval = [], self.streams, self.interval
        for d in deltas:
            seqs = streams.setdefault(d.request_id, {})
            started = d.index in seqs
            held = seqs.get(d.index)
            if held is not None:
                d = _merged(held, d)
            if d.finish_reason is not None:
                out.append(d)
                seqs.pop(d.index, None)
                if not seqs:
                    del streams[d.request_id]
            elif len(d.token_ids) >= interval or (d.token_ids and not started) or d.prompt_logprobs:
                out.append(d)
                seqs[d.index] = None
            else:
                seqs[d.index] = d
        return out

    def forget(self, live: Callable[[str], bool]) -> None:
        """Drops every request for which `live(request_id)` is False."""
        for request_id in [r for r in self.streams if not live(r)]:
            del self.streams[request_id]


def client_name(frames: list[bytes]) -> tuple[str, str] | str:
    """(kind, why) for a message that is not [identity, payload] from a client that named itself (a DEALER with a
    UTF-8 identity without SEP), else the client's name. A REQ socket adds an empty frame; a DEALER without an
    identity gets one generated by zmq (its first byte 0)."""
    if len(frames) != 2:
        return "frames", f"a message of {len(frames)} frames (a client sends its name and one payload: a DEALER, not " \
                         "a REQ socket)"
    identity = frames[0]
    if not identity or identity[0] == 0:
        return "identity", "a message from a client without a name (a DEALER without a zmq identity)"
    try:
        name = identity.decode()
    except UnicodeDecodeError:
        return "identity", f"a message from a client whose name is not UTF-8 ({identity[:32]!r})"
    if SEP in name:
        return "identity", f"a message from a client whose name holds the separator \\x1f ({name[:32]!r})"
    return name


@dataclass
class _Client:
    name: str
    output_address: str
    output: zmq.Socket
    last_seen: float


class EngineCoreProc:
    """Owns the engine and the sockets; single-threaded but for the heartbeat thread (its own sockets)."""

    def __init__(self, engine: Any, config: CoreConfig, num_threads: int) -> None:
        self.engine = engine
        self.config = config
        self.ctx = zmq.Context()
        self.curve = curve.from_env()  # tcp sockets are CURVE with keys (ipc/curve.py)
        self.input = self.ctx.socket(zmq.ROUTER)
        # no ROUTER_HANDOVER: a connection under a name in use is refused, so no one takes over a live client; zmq
        # heartbeats find a connection that died without closing (a crashed machine), so its client may come back
        self.input.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.input.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        curve.secure_server(self.input, config.input_address, self.curve)
        self.input.bind(config.input_address)
        self.clients: dict[str, _Client] = {}
        self._clients_lock = threading.Lock()
        self.utilities: dict[str, Callable[..., Any]] = {"stats": lambda e: e.stats(), **LORA_UTILITIES}
        self.pollers: list[Callable[[], None]] = []  # run every loop iteration (plugins: runtime/disagg's roles)
        self._unscheduled: dict[str, float] = {}  # engine request id -> when it was added
        self.coalescer = StreamCoalescer(config.stream_interval)
        self.num_step_errors = 0
        self.dropped = DropLog(logger=logger)
        self.deferred: list[tuple[str, int, Deferred]] = []  # (client, call id, its answer to come): utilities' answers
        self.executor_failure: str | None = None  # set by a mesh executor's watcher thread (a rank died)
        self.latest = (0, CoreStats())  # (version, stats): one tuple, read by the heartbeat thread
        art = engine.artifact
        manifest = art.manifest
        tok = manifest.get("tokenizer")  # null: an artifact without one (random weights) serves token ids only
        from kiln import __version__
        self.info = CoreInfo(
            protocol_version=PROTOCOL_VERSION, kiln_version=__version__, pid=os.getpid(), artifact=str(art.path),
            input_address=config.input_address, limits=engine.limits, max_waiting=config.max_waiting,
            device=str(art.device), target=manifest.get("target"), arch=(manifest.get("model") or {}).get("name"),
            served_name=(manifest.get("serve") or {}).get("served_name"),
            tokenizer_dir=str(art.path / tok["dir"]) if tok is not None else None,
            kv_bytes=int(engine.runner.memory_plan["kv_bytes"]), async_scheduling=engine.async_scheduling,
            speculative=engine.speculative.method if engine.speculative else None, num_threads=num_threads,
            cpus=threads.allowed_cpus(), max_seqs=engine.scheduler.config.max_seqs,
            max_batched_tokens=engine.scheduler.config.max_batched_tokens,
            embedding=embedding_section(manifest))

    def register_utility(self, name: str, fn: Callable[..., Any]) -> None:
        """`fn(engine, *args)`, run between two steps for a client's `UtilityCall(name, args)`; its result must
        be msgpack-encodable, or a `Deferred` (deferred.py: work on a thread, answered when it is done)."""
        self.utilities[name] = fn

    # The loop ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        threading.Thread(target=self._heartbeats, name="kiln-core-heartbeat", daemon=True).start()
        engine, idle_ms = self.engine, int(self.config.heartbeat_interval * 1000)
        watch = getattr(engine.runner, "on_failure", None)  # a mesh executor reports a rank dying while idle too
        if watch is not None:
            watch(lambda reason: setattr(self, "executor_failure", reason))
        while True:  # idle with a deferred answer to come: look for it every 5 ms
            received = self._receive(0 if engine.has_unfinished_requests() else min(idle_ms, 5) if self.deferred
                                     else idle_ms)
            for poll in self.pollers:
                poll()
            if self.deferred:
                self._answer_deferred()
            self._expire_clients()
            if self.executor_failure is not None:
                self._executor_died(ExecutorError(f"the model's ranks cannot run: {self.executor_failure}"))
            if engine.has_unfinished_requests():
                self._step()
            elif received:  # aborts may have emptied the engine: the heartbeats' stats say so
                self._update_stats()

    def _receive(self, timeout_ms: int) -> bool:
        """Handles every message waiting (waits up to `timeout_ms` for the first); False if there was none."""
        sock = self.input
        if not sock.poll(timeout_ms):
            return False
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            name = client_name(frames)
            if isinstance(name, tuple):
                self.dropped(*name)
                continue
            try:
                self._handle(name, frames[1])
            except Exception as e:  # a message nothing above foresaw: it is dropped, the core keeps serving
                logger.debug("message from client %r failed", name, exc_info=True)
                self.dropped("failed", "a message from client %r that failed: %s: %s", name, type(e).__name__, e)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            deltas = self.engine.step()
        except ExecutorError as e:  # the model's ranks are gone: no step can run again
            self._executor_died(e)
        except Exception as e:  # fails the requests in flight, never the loop
            logger.exception("engine step failed; failing %d request(s)", len(self.engine.requests))
            self.num_step_errors += 1
            deltas = self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
        scheduled = self._newly_scheduled(start)
        self._update_stats()
        self._publish(deltas, scheduled)

    def _executor_died(self, error: ExecutorError) -> None:
        """Every request in flight fails with the reason, then the core exits 1: its API servers see it gone (a
        server stops, exit status non-zero). The worker ranks are stopped first."""
        logger.error("%s; failing %d request(s) and exiting", error, len(self.engine.requests))
        self._publish(self._fail_all(str(error)), [])
        try:
            self.engine.runner.shutdown()
        finally:
            time.sleep(0.2)  # the PUSH sockets flush the failures (linger) before the process goes
            os._exit(1)

    def _publish(self, deltas: list[SeqDelta], scheduled: list[tuple[str, float]]) -> None:
        """One StepOutputs per client that has anything in this step (after the coalescer held back what it
        holds); ids back to the client's own."""
        version, stats = self.latest
        coalescer = self.coalescer
        if coalescer.interval > 1:
            deltas = coalescer(deltas)
            coalescer.forget(self.engine.requests.__contains__)  # aborted: nothing more is sent for them
        per_client: dict[str, tuple[list, list]] = {}
        for d in deltas:
            name, _, d.request_id = d.request_id.partition(SEP)
            per_client.setdefault(name, ([], []))[0].append(d)
        for request_id, waited in scheduled:
            name, _, own = request_id.partition(SEP)
            per_client.setdefault(name, ([], []))[1].append((own, waited))
        for name, (client_deltas, client_scheduled) in per_client.items():
            client = self.clients.get(name)
            if client is not None:
                self._send(client, StepOutputs(version, client_deltas, stats, client_scheduled))

    def _newly_scheduled(self, start: float) -> list[tuple[str, float]]:
        """(request id, seconds queued) of the requests that left the waiting queue in this step."""
        out = []
        requests = self.engine.requests
        for request_id, arrival in list(self._unscheduled.items()):
            request = requests.get(request_id)
            if request is None or any(s.status is not WAITING for s in request.seqs):
                del self._unscheduled[request_id]
                out.append((request_id, max(0.0, start - arrival)))
        return out

    def _update_stats(self) -> None:
        s = self.engine.stats()
        self.latest = (self.latest[0] + 1, CoreStats(s["num_running"], s["num_waiting"], s["kv_usage"], s["num_preemptions"],
                               s["prefix_cache_queries"], s["prefix_cache_hits"], s["spec_num_draft_tokens"],
                               s["spec_num_accepted_tokens"], s["num_nonfinite_logits"], self.num_step_errors,
                               s["spec_num_drafts"], *(s[f] for f in KV_BLOCK_FIELDS)))

    def _fail_all(self, error: str) -> list[SeqDelta]:
        engine = self.engine
        for request_id in list(engine.requests):
            try:
                engine.end_request(request_id, "error", error)
            except Exception:  # best effort after a failed step; the request is gone either way
                engine.requests.pop(request_id, None)
        self._unscheduled.clear()
        return engine.take_pending()

    # Messages ---------------------------------------------------------------------------------------------
    def _handle(self, name: str, payload: bytes) -> None:
        try:
            msg = core_decoder.decode(payload)
        except msgspec.DecodeError as e:
            self.dropped("decode", "a message from client %r that does not decode: %s", name, e)
            return
        if isinstance(msg, Hello):
            self._hello(name, msg)
            return
        client = self.clients.get(name)
        if client is None:
            self.dropped("unknown", "a %s from client %r, which has not said Hello", type(msg).__name__, name)
            return
        client.last_seen = time.monotonic()
        if isinstance(msg, AddRequests):
            self._send(client, self._add(name, msg))
        elif isinstance(msg, Abort):
            engine = self.engine
            for request_id in msg.request_ids:
                engine.abort_request(name + SEP + request_id)
                self._unscheduled.pop(name + SEP + request_id, None)
            if msg.seqs:
                engine.finish_sequences([(name + SEP + request_id, index) for request_id, index in msg.seqs])
        elif isinstance(msg, UtilityCall):
            result = self._utility(msg)
            if isinstance(result, Deferred):
                self.deferred.append((name, msg.call_id, result))
            else:
                self._send(client, result)
        elif isinstance(msg, Goodbye):
            self._drop(name)

    def _hello(self, name: str, msg: Hello) -> None:
        address = msg.output_address
        if not address.startswith(("ipc://", "tcp://")):
            self.dropped("hello", "a Hello from client %r whose output address %.80r is not ipc:// or tcp://",
                         name, address)
            return
        output = self.ctx.socket(zmq.PUSH)
        output.setsockopt(zmq.SNDHWM, 0)  # never block the core on a slow client (a dead one times out)
        output.setsockopt(zmq.LINGER, 0)
        try:
            curve.secure_client(output, address, self.curve)
            output.connect(address)
        except zmq.ZMQError as e:
            output.close()
            self.dropped("hello", "a Hello from client %r whose output address %.80r is no endpoint: %s", name,
                         address, e)
            return
        client = _Client(name, address, output, time.monotonic())
        if msg.protocol_version != PROTOCOL_VERSION:
            self._send(client, Welcome(None, f"the engine core speaks protocol version {PROTOCOL_VERSION}, the "
                                             f"client {msg.protocol_version}: run the same kiln on both sides"))
            output.close(linger=1000)
            return
        if name in self.clients:  # its name again: a restarted client (its old connection is gone); old requests void
            self._drop(name)
        with self._clients_lock:
            self.clients[name] = client
        self._send(client, Welcome(self.info))

    def _add(self, name: str, msg: AddRequests) -> AddResult:
        """All of the requests or none; refused while the sequences waiting would pass `max_waiting`."""
        engine, added = self.engine, []
        try:
            batch = []
            for r in msg.requests:
                try:
                    batch.append((r, decode_params(r.params)))
                except msgspec.ValidationError as e:
                    raise RequestError(str(e)) from None
            num_seqs = sum(params.n for _, params in batch)
            sched = engine.scheduler
            waiting = len(sched.waiting) + len(sched.swapped)
            if waiting + num_seqs > self.config.max_waiting:
                return AddResult(msg.call_id, f"the server is overloaded ({waiting} sequences waiting, this request "
                                 f"adds {num_seqs}, limit {self.config.max_waiting}); retry later", overloaded=True)
            now = time.monotonic()
            for r, params in batch:
                request_id = name + SEP + r.request_id
                engine.add_request(request_id, r.prompt_token_ids, params, priority=r.priority,
                                   lora_name=r.lora_name)
                added.append(request_id)
                self._unscheduled[request_id] = now
        except Exception as e:  # RequestError is the client's; anything else is reported too
            for request_id in added:
                engine.abort_request(request_id)
                self._unscheduled.pop(request_id, None)
            return AddResult(msg.call_id, str(e) if isinstance(e, RequestError) else f"cannot add the request: {e}")
        return AddResult(msg.call_id)

    def _utility(self, msg: UtilityCall) -> UtilityResult | Deferred:
        fn = self.utilities.get(msg.method)
        if fn is None:
            return UtilityResult(msg.call_id, error=f"unknown utility {msg.method!r} (known: "
                                                    f"{', '.join(sorted(self.utilities))})")
        try:
            result = fn(self.engine, *msg.args)
        except Exception as e:
            return UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}")
        return result if isinstance(result, Deferred) else UtilityResult(msg.call_id, result)

    def _answer_deferred(self) -> None:
        """Answers the deferred utility calls whose work is done: `finish` runs here, between two steps; a client
        gone since gets nothing."""
        for item in [d for d in self.deferred if d[2].future.done()]:
            self.deferred.remove(item)
            name, call_id, deferred = item
            try:
                result = UtilityResult(call_id, deferred.finish(deferred.future))
            except Exception as e:
                result = UtilityResult(call_id, error=f"{type(e).__name__}: {e}")
            client = self.clients.get(name)
            if client is not None:
                self._send(client, result)

    def _send(self, client: _Client, msg: Any) -> None:
        try:
            payload = encode(msg)
        except (TypeError, OverflowError) as e:  # a utility's result that does not encode
            payload = encode(UtilityResult(msg.call_id, error=f"the result does not encode: {e}"))
        client.output.send(payload, copy=len(payload) < 65536)

    # Clients ----------------------------------------------------------------------------------------------
    def _expire_clients(self) -> None:
        deadline = time.monotonic() - self.config.client_timeout
        for name in [n for n, c in self.clients.items() if c.last_seen < deadline]:
            logger.warning("client %r sent nothing for %g s: dropping it and its requests", name,
                           self.config.client_timeout)
            self._drop(name)

    def _drop(self, name: str) -> None:
        with self._clients_lock:
            client = self.clients.pop(name, None)
        if client is None:
            return
        client.output.close()
        prefix = name + SEP
        for request_id in [r for r in self.engine.requests if r.startswith(prefix)]:
            self.engine.abort_request(request_id)
            self._unscheduled.pop(request_id, None)

    def _heartbeats(self) -> None:
        """Every `heartbeat_interval`: a Heartbeat to each client, on sockets of this thread's own."""
        sockets: dict[str, tuple[str, zmq.Socket]] = {}
        parent = self.config.parent_pid
        while True:
            time.sleep(self.config.heartbeat_interval)
            if parent is not None and os.getppid() != parent:
                os._exit(1)  # our API server is gone (PDEATHSIG missed it, e.g. not Linux)
            with self._clients_lock:
                targets = {name: c.output_address for name, c in self.clients.items()}
            for name in [n for n in sockets if sockets[n][0] != targets.get(n)]:
                sockets.pop(name)[1].close()
            payload = encode(Heartbeat(*self.latest))
            for name, address in targets.items():
                if name not in sockets:
                    sock = self.ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.SNDHWM, 4)
                    sock.setsockopt(zmq.LINGER, 0)
                    curve.secure_client(sock, address, self.curve)
                    sock.connect(address)
                    sockets[name] = (address, sock)
                try:
                    sockets[name][1].send(payload, zmq.NOBLOCK)
                except zmq.Again:  # the client is not reading; it times out on its own
                    pass


# Startup ---------------------------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int | None) -> None:
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before prctl
        os._exit(1)


def _load_plugin(spec: str) -> Callable[[EngineCoreProc], None]:
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"_kiln_core_plugin_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, attr)


def _report(fd: int, msg: Ready | StartupFailed) -> None:
    with os.fdopen(fd, "wb") as pipe:
        pipe.write(encode(msg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.core.process")
    parser.add_argument("--config", required=True, help="a CoreConfig, as JSON")
    parser.add_argument("--ready-fd", type=int, required=True, help="pipe to write Ready / StartupFailed to")
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config, type=CoreConfig)
    _die_with_parent(config.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="kiln core %(levelname)s: %(message)s")
    try:
        if config.cpus:
            threads.pin(config.cpus)
    except (OSError, ValueError) as e:  # a CPU the machine does not have, or one outside our cgroup's cpuset
        _report(args.ready_fd, StartupFailed(f"the engine core cannot run on CPUs "
                                             f"{threads.format_cpu_list(config.cpus)}: {e}", user_error=True))
        return 2
    num_threads = threads.configure_core(config.num_threads)
    try:
        from .engine import EngineCore

        engine = EngineCore(config.artifact, device=config.device, **config.engine)
        proc = EngineCoreProc(engine, config, num_threads)
        for plugin in config.plugins:
            _load_plugin(plugin)(proc)
    except KilnRuntimeError as e:
        _report(args.ready_fd, StartupFailed(str(e), user_error=True))
        return 2
    except Exception as e:
        logger.exception("the engine core failed to start")
        _report(args.ready_fd, StartupFailed(f"the engine core failed to start: {type(e).__name__}: {e}", False))
        return 1
    _report(args.ready_fd, Ready(proc.info))
    proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
