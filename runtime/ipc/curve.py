"""CURVE security (ZeroMQ's CurveZMQ: Curve25519 keys, authenticated encryption) for kiln's pyzmq sockets on TCP.

`kiln keys generate DIR` writes a key directory, copied to every machine of a deployment:

    DIR/server.key, server.key_secret    the keypair of every socket that binds (a core's control endpoint, a
                                         decode core's KV receiver, an API server's or router's output socket)
    DIR/client.key, client.key_secret    the keypair of every socket that connects to one of those
    DIR/authorized_clients/*.key         the client public keys the binding sockets accept (a copy of client.key)

Secret files are mode 0600 (`load` refuses them readable by anyone but their owner). With keys (`--curve-keys
DIR`, or `KILN_CURVE_KEYS=DIR`, which every process kiln starts inherits), every tcp:// socket of the control and
KV planes is CURVE: a binding socket is a CURVE server whose ZAP handler (zmq.auth.thread.ThreadAuthenticator,
one per context) admits only the authorized client keys; a connecting socket proves its client key and checks the
server's public key. So a peer without `client.key_secret` gets no message through in either direction (the
handshake fails before any message is delivered), one without `server.key_secret` cannot pose as a core or a KV
receiver, and everything on the wire is encrypted and authenticated (each message carries Poly1305 MAC; a forged,
replayed or altered message is dropped by libzmq). ipc:// sockets (a single host's control plane) are left as
they are: their directory is private to the user (mkdtemp, 0700).

Without keys, a socket bound on an address other than loopback lets anyone who reaches it submit and abort
requests or inject KV frames: `refuse_exposed` makes that a startup error unless `--insecure` is given.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ..errors import KilnRuntimeError

logger = logging.getLogger("kiln.curve")

ENV = "KILN_CURVE_KEYS"
AUTHORIZED = "authorized_clients"
_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")


@dataclass(frozen=True)
class CurveKeys:
    """A loaded key directory (z85-encoded keys, as pyzmq's socket options take them)."""
    directory: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized: frozenset[bytes]


def generate(directory: str | os.PathLike, *, force: bool = False) -> list[Path]:
    """Writes a fresh key directory (DIR 0700, secrets 0600); refuses to replace existing keys unless `force`.
    Returns the files written."""
    _require_curve()
    root = Path(directory)
    existing = [root / f for f in _FILES if (root / f).exists()]
    if existing and not force:
        raise KilnRuntimeError(f"{existing[0]} exists: keys are not overwritten (give --force to replace every key "
                               f"in {root}; the machines holding the old ones must get the new directory)")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    authorized = root / AUTHORIZED
    if force and authorized.exists():
        shutil.rmtree(authorized)
    authorized.mkdir(mode=0o700, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret files never exist readable by others, not even for a moment
    try:
        written = []
        for name in ("server", "client"):
            for path in map(Path, zmq.auth.create_certificates(root, name)):
                path.chmod(0o600)
                written.append(path)
        shutil.copyfile(root / "client.key", authorized / "client.key")
        written.append(authorized / "client.key")
    finally:
        os.umask(old_umask)
    return written


def load(directory: str | os.PathLike) -> CurveKeys:
    """Reads and checks a key directory; a clear KilnRuntimeError (exit 2) for what is missing, unreadable,
    readable by others or not a key."""
    _require_curve()
    root = Path(directory)
    hint = f"create one with `kiln keys generate {root}`"
    if not root.is_dir():
        raise KilnRuntimeError(f"CURVE keys: {root} is not a directory; {hint}")
    keys = {}
    for name in _FILES:
        path = root / name
        if not path.is_file():
            raise KilnRuntimeError(f"CURVE keys: {path} is missing; {hint}")
        if name.endswith("_secret"):
            st = path.stat()
            if st.st_mode & 0o077:
                raise KilnRuntimeError(f"CURVE keys: {path} is readable by others (mode "
                                       f"{stat.filemode(st.st_mode)}); a secret key must be private: chmod 600 {path}")
            if st.st_uid != os.getuid():
                raise KilnRuntimeError(f"CURVE keys: {path} belongs to another user (uid {st.st_uid}); a secret key "
                                       "must be the serving user's own")
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise KilnRuntimeError(f"CURVE keys: {path} is not a ZeroMQ certificate ({e}); {hint}") from None
        if name.endswith("_secret") and not secret:
            raise KilnRuntimeError(f"CURVE keys: {path} holds no secret key; {hint}")
        keys[name] = (public, secret)
    authorized_dir = root / AUTHORIZED
    try:
        authorized = frozenset(zmq.auth.load_certificates(authorized_dir)) if authorized_dir.is_dir() else frozenset()
    except (OSError, ValueError) as e:
        raise KilnRuntimeError(f"CURVE keys: {authorized_dir} holds a file that is not a certificate ({e})") from None
    if not authorized:
        raise KilnRuntimeError(f"CURVE keys: no client key is authorized ({authorized_dir}/*.key); copy "
                               f"{root / 'client.key'} there")
    return CurveKeys(str(root.resolve()), keys["server.key_secret"][0], keys["server.key_secret"][1],
                     keys["client.key_secret"][0], keys["client.key_secret"][1], authorized)


_from_env: dict[str, CurveKeys] = {}


def from_env() -> CurveKeys | None:
    """The keys named by KILN_CURVE_KEYS (loaded once per directory), else None."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if directory not in _from_env:
        _from_env[directory] = load(directory)
    return _from_env[directory]


def use(directory: str | None) -> CurveKeys | None:
    """`--curve-keys DIR`: loads and checks DIR (a clear error before anything starts) and exports it to every
    process started from here; without the flag, KILN_CURVE_KEYS if set."""
    if directory:
        keys = load(directory)
        os.environ[ENV] = keys.directory
        return keys
    return from_env()


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise KilnRuntimeError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE security; install a "
                               "pyzmq wheel (they bundle libzmq with libsodium/tweetnacl)")


# Sockets ----------------------------------------------------------------------------------------------------
class _Authorized:
    """The ZAP handler's credentials provider: a client key is admitted iff it is in the authorized set."""

    def __init__(self, keys: CurveKeys) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys.authorized:
            return True
        if key not in self.refused:  # once per key: a client retrying every 100 ms would flood the log
            self.refused.add(key)
            logger.warning("refused a CURVE client whose key %s is not in %s/%s", key.decode(), self.keys.directory,
                           AUTHORIZED)
        return False


_authenticators: dict[int, tuple[ThreadAuthenticator, CurveKeys]] = {}  # libzmq context address -> its handler


def _authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Starts the ZAP handler of `ctx` (once): without one, libzmq would admit every client that knows the server's
    public key. Every CURVE server socket of a context admits the same clients (ZAP is per context)."""
    running = _authenticators.get(ctx.underlying)
    if running is not None:
        assert running[1].authorized == keys.authorized, (
            f"one context, two sets of authorized clients ({running[1].directory}, {keys.directory})")
        return
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=logger)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_Authorized(keys))
    _authenticators[ctx.underlying] = (auth, keys)


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stops `ctx`'s ZAP handler, if it has one (before `ctx.term()`, which would wait for its socket)."""
    running = _authenticators.pop(ctx.underlying, None)
    if running is not None:
        running[0].stop()


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def secure_server(sock: zmq.Socket, address: str, keys: CurveKeys | None) -> None:
    """Before `sock` binds `address`: a CURVE server admitting only authorized clients (tcp with keys only)."""
    if keys is None or not is_tcp(address):
        return
    _authenticator(sock.context, keys)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, address: str, keys: CurveKeys | None) -> None:
    """Before `sock` connects to `address`: a CURVE client with the client key, expecting the server key."""
    if keys is None or not is_tcp(address):
        return
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)


class HandshakeWatch:
    """Watches a connecting socket's handshakes (a zmq monitor) so that a peer refusing this side's security
    is reported at once, with its reason, instead of as silence: `failure()` is None while nothing failed. A
    refusal (ZAP) or a mechanism mismatch is conclusive at once; a handshake that fails without detail (what a
    CURVE client sees from a server of another key) only when it repeats: a peer gone mid-handshake looks alike."""

    def __init__(self, sock: zmq.Socket, keys: CurveKeys | None) -> None:
        self.sock, self.keys = sock, keys
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self.failures = 0  # handshakes failed without detail since the last that succeeded

    def failure(self, address: str, peer: str, final: bool = False) -> str | None:
        """`final`: the caller gives up now (its timeout), so one failed handshake is reason enough."""
        from zmq.utils.monitor import recv_monitor_message

        with contextlib.suppress(zmq.ZMQError):
            while self.monitor.poll(0):
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
                kind = event["event"]
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.failures = 0
                elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    self.failures += 1
                else:
                    return _describe(kind, event["value"], address, peer, self.keys)
        if self.failures >= (1 if final else 3):
            return _describe(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, address, peer, self.keys)
        return None

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)


def _describe(kind: int, value: int, address: str, peer: str, keys: CurveKeys | None) -> str:
    mine = keys.directory if keys is not None else None
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the {peer} at {address} refused this process's CURVE client key (not in its {AUTHORIZED}): give "
                "both sides the same key directory (--curve-keys)")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if mine:
            return (f"the {peer} at {address} does not run with CURVE keys and this process does ({mine}): start "
                    "both with --curve-keys, or neither")
        return (f"the {peer} at {address} requires CURVE keys (it runs with --curve-keys): give this process the "
                "same key directory (--curve-keys DIR or KILN_CURVE_KEYS)")
    if mine:  # a CURVE handshake that failed without a reason: the server is not the one server.key names
        return (f"the CURVE handshake with the {peer} at {address} failed: its server key is not the one in {mine}/"
                "server.key (another key directory?)")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # A CURVE server closes a plain client's connection once it sees the mechanism; the client reports the
        # mismatch only when it read the server's greeting first, and otherwise sees handshakes fail without a
        # reason, again and again (a race that load makes likely).
        return (f"the handshake with the {peer} at {address} failed repeatedly without a reason: the {peer} most "
                "likely requires CURVE keys (it runs with --curve-keys): give this process the same key directory "
                "(--curve-keys DIR or KILN_CURVE_KEYS)")
    return f"the handshake with the {peer} at {address} failed (zmq event {kind:#x}, {value:#x})"


# Exposure ---------------------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def refuse_exposed(what: list[tuple[str, str]], keys: CurveKeys | None, insecure: bool, command: str) -> None:
    """`what`: (description, host) of the sockets about to listen. Without keys, one on a non-loopback host is a
    startup error (KilnRuntimeError: exit 2) unless `insecure`, which turns it into a loud warning."""
    if keys is not None:
        return
    exposed = [f"{desc} ({host})" for desc, host in what if not is_loopback(host)]
    if not exposed:
        return
    message = (f"{command}: {', '.join(exposed)} would listen beyond this machine without authentication: anyone "
               "who reaches it could speak kiln's control and KV protocols (submit or abort requests, forge outputs, "
               "inject KV)")
    if not insecure:
        raise KilnRuntimeError(f"{message}. Create keys (`kiln keys generate DIR`, copy DIR to every machine) and "
                               "give --curve-keys DIR to every core and router, or pass --insecure on a network you "
                               "trust")
    print(f"WARNING: {message} (--insecure: run it only on a network you trust)", file=sys.stderr, flush=True)


def warn_nixl(keys: CurveKeys | None, exposed: bool) -> None:
    """KV over NIXL moves through UCX, outside CURVE: said at startup when the operator asked for security (keys)
    or the receiver is reachable beyond loopback."""
    if keys is not None or exposed:
        print("WARNING: KV over NIXL moves through UCX, which CURVE does not cover: its frames are neither encrypted "
              "nor authenticated (the digests catch corruption, not forgery); use --kv-transport tcp where the "
              "network is not trusted", file=sys.stderr, flush=True)
