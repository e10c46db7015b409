"""CURVE on the control and KV planes (runtime/ipc/curve.py): `kiln keys generate` and the checks on a key
directory (exit 2, nothing started); a core or router that would listen beyond loopback without keys is refused;
a KV receiver admits only authorized senders; a remote prefill/decode pair and `kiln router`, all with
`--curve-keys`, answer what co-located serving answers, while clients without keys, with an unauthorized key or
expecting another server key get nothing through (a clear error at once, not a timeout), the cores serve on."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import stat
import uuid

import httpx
import pytest
from kiln.runtime.core.engine import EngineCore
from kiln.runtime.disagg.transport import TransportClosed, ZmqTransport
from kiln.runtime.errors import KilnRuntimeError
from kiln.runtime.ipc import curve
from kiln.runtime.ipc.client import AsyncCoreClient
from kiln.runtime.ipc.protocol import AddRequests, NewRequest, encode_params
from kiln.runtime.sampling_params import SamplingParams
from pair import run_colocated
from remote_cluster import Cluster, core_utility

from kiln.cli import main

MAX_TOKENS = 6
PROMPTS = [[5, 9, 13], [7] * 9, list(range(3, 40)), list(range(60, 3, -1))]


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch):
    """`--curve-keys` exports KILN_CURVE_KEYS: never into the other tests of this process."""
    monkeypatch.delenv(curve.ENV, raising=False)


@pytest.fixture(scope="module")
def keydirs(tmp_path_factory):
    """The deployment's keys; another deployment's; an attacker who knows the deployment's server public key
    (it is not secret) and has a client key of its own."""
    root = tmp_path_factory.mktemp("curve")
    for name in ("cluster", "other"):
        curve.generate(root / name)
    cluster, other = curve.load(root / "cluster"), curve.load(root / "other")
    return {"dir": root / "cluster", "cluster": cluster, "other": other,
            "attacker": dataclasses.replace(other, server_public=cluster.server_public)}


def test_keys_generate_and_bad_key_directories(tmp_path, artifact_dir, capsys):
    d = tmp_path / "keys"
    assert main(["keys", "generate", str(d)]) == 0
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((d / f).stat().st_mode) == 0o600
    keys = curve.load(d)
    assert keys.authorized == {keys.client_public} and keys.server_public != keys.client_public
    capsys.readouterr()
    assert main(["keys", "generate", str(d)]) == 2  # never overwritten by accident
    assert "exists" in capsys.readouterr().err and curve.load(d) == keys

    def broken(name, damage):
        bad = tmp_path / name
        shutil.copytree(d, bad)
        damage(bad)
        return bad

    cases = [
        (broken("loose", lambda b: (b / "client.key_secret").chmod(0o640)), "client.key_secret is readable by others"),
        (broken("missing", lambda b: (b / "server.key").unlink()), "server.key is missing"),
        (broken("garbage", lambda b: (b / "server.key_secret").write_text("hello")), "not a ZeroMQ certificate"),
        (broken("nobody", lambda b: (b / curve.AUTHORIZED / "client.key").unlink()), "no client key is authorized"),
        (tmp_path / "absent", "is not a directory; create one with `kiln keys generate"),
    ]
    for bad, message in cases:
        assert main(["serve", str(artifact_dir), "--role", "both", "--port", "9", "--curve-keys", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert main(["router", "--replica", "127.0.0.1:9", "--curve-keys", str(bad)]) == 2
        assert message in capsys.readouterr().err


def test_listening_beyond_loopback_needs_keys_or_insecure(artifact_dir, capsys):
    """Refused before anything starts (exit 2); loopback needs nothing; --insecure is a loud warning."""
    assert main(["serve", str(artifact_dir), "--role", "prefill", "--host", "10.11.12.13", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert "the control endpoint (10.11.12.13) would listen beyond this machine" in err
    assert "--curve-keys" in err and "--insecure" in err and "Traceback" not in err
    assert main(["router", "--replica", "10.11.12.13:9", "--replica", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "core at tcp://10.11.12.13:9 (10.11.12.13)" in err and "127.0.0.1" not in err, err
    curve.refuse_exposed([("a", "127.0.0.1"), ("b", "::1"), ("c", "localhost"), ("d", "[::1]")], None, False, "t")
    curve.refuse_exposed([("e", "10.0.0.1")], None, True, "t")
    assert "WARNING: t: e (10.0.0.1) would listen beyond this machine" in capsys.readouterr().err


def _try_send(endpoint: str, keys, frame: bytes) -> str:
    sender = ZmqTransport(endpoint, bind=False, send_timeout_s=1.0, keys=keys)
    try:
        sender.send(frame)
        return "sent"
    except TransportClosed as e:
        return str(e)
    finally:
        sender.close()


def test_kv_receiver_admits_only_authorized_senders(keydirs):
    cluster = keydirs["cluster"]
    receiver = ZmqTransport.bind("tcp://127.0.0.1", keys=cluster)
    plain = ZmqTransport.bind("tcp://127.0.0.1")
    try:
        assert "refused this process's CURVE client key" in _try_send(receiver.endpoint, keydirs["attacker"], b"x")
        assert "requires CURVE keys" in _try_send(receiver.endpoint, None, b"y")
        assert "server key is not the one" in _try_send(receiver.endpoint, keydirs["other"], b"z")
        assert "does not run with CURVE keys" in _try_send(plain.endpoint, cluster, b"w")
        assert receiver.recv(0.2) == [] and plain.recv(0.0) == []
        assert _try_send(receiver.endpoint, cluster, b"frame") == "sent"  # it still serves the authorized
        assert receiver.recv(5.0) == [b"frame"]
    finally:
        receiver.close()
        plain.close()


@pytest.fixture(scope="module")
def bare(artifact_dir, tmp_path_factory):
    """The stand-in artifact without its tokenizer: the server answers token ids."""
    path = tmp_path_factory.mktemp("curve-art") / "standin"
    shutil.copytree(artifact_dir, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tokenizer"] = None
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _complete(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(url + "/v1/completions", json={"model": "standin", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0.0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _intrude(url: str, keys) -> str:
    """A client of the core at `url` with `keys`: it queues a request before its handshake, then connects; the
    error it gets."""
    async def attempt() -> str:
        client = AsyncCoreClient("tcp://" + url, name=f"intruder-{uuid.uuid4().hex[:6]}", keys=keys)
        try:
            client.send(AddRequests(1, [NewRequest("evil", [5, 6, 7], encode_params(SamplingParams()))]))
            with pytest.raises(KilnRuntimeError) as error:
                await client.connect(timeout=20)
            return str(error.value)
        finally:
            client.close()

    return asyncio.run(attempt())


def test_remote_pair_over_curve(bare, keydirs):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = run_colocated(EngineCore(bare, num_kv_blocks=256), PROMPTS, params)
    keys, flags = keydirs["cluster"], ("--curve-keys", str(keydirs["dir"]))
    cluster = Cluster()
    try:
        prefill = cluster.core(bare, "prefill", *flags, wait=False)
        decode = cluster.core(bare, "decode", *flags, wait=False)
        for core in (prefill, decode):
            cluster.ready(core)
            assert f"CURVE keys {keys.directory}" in core.output()
        router = cluster.router("--prefill", prefill.url, "--decode", decode.url, "--remote-prefill", "always",
                                *flags)
        for i, p in enumerate(PROMPTS):
            assert _complete(router.url, p) == reference[f"r{i}"][0], i

        # Clients without the deployment's client key get nothing through, and are told why at once.
        assert "requires CURVE keys" in _intrude(decode.url, None)
        assert "refused this process's CURVE client key" in _intrude(decode.url, keydirs["attacker"])
        assert "server key is not the one" in _intrude(prefill.url, keydirs["other"])
        with pytest.raises(KilnRuntimeError, match="requires CURVE keys"):  # `kiln router` without keys: exit 2
            from kiln.runtime.disagg.remote import build_router
            build_router([], [], [decode.url], probe_timeout=20)
        # KV frames from a sender without the client key never reach the decode core's checks
        endpoint = core_utility(decode.url, "disagg_init", {}, keys=keys)["endpoint"]
        assert "refused this process's CURVE client key" in _try_send(endpoint, keydirs["attacker"], b"forged")
        assert "requires CURVE keys" in _try_send(endpoint, None, b"forged")
        assert core_utility(decode.url, "disagg_stats", keys=keys)["bad_frames"] == 0
        assert _try_send(endpoint, keys, b"not a frame") == "sent"  # what does arrive is checked (and counted)
        for _ in range(50):
            if core_utility(decode.url, "disagg_stats", keys=keys)["bad_frames"] == 1:
                break
        else:
            raise AssertionError("the authorized sender's frame did not arrive")
        stats = core_utility(decode.url, "stats", keys=keys)
        assert stats["num_running"] == stats["num_waiting"] == 0, stats  # the intruders' requests never arrived
        assert "refused a CURVE client whose key" in decode.output()

        for i, p in enumerate(PROMPTS):  # and the deployment serves on
            assert _complete(router.url, p) == reference[f"r{i}"][0], i
        s = core_utility(decode.url, "disagg_stats", keys=keys)
        assert s["transfers"]["succeeded"] == s["decisions"]["remote"] > 0 and s["leases"] == 0, s
    finally:
        cluster.close()
