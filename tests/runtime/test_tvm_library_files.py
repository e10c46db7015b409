"""The TVM kernel library file the loader maps: checked against build.json's digest, and copied (when its path is
already mapped) only into this process's private directory, never to a shared temp path another user can plant."""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

import pytest
from kiln.runtime import tvm_kernels


@pytest.fixture
def fresh(monkeypatch):
    """No library mapped yet and no private directory made, in this test's view of the process."""
    monkeypatch.setattr(tvm_kernels, "_mapped", {})
    monkeypatch.setattr(tvm_kernels, "_private", [])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_recompiled_library_is_copied_privately_not_to_a_planted_path(tmp_path, fresh):
    lib = tmp_path / "cpu.so"
    lib.write_bytes(b"first build")
    assert tvm_kernels.library_to_map(lib, _sha(b"first build")) == lib
    lib.write_bytes(b"second build")  # recompiled in place: the loader still maps the first from `lib`
    second = _sha(b"second build")
    planted = Path(tempfile.gettempdir()) / f"kiln-tvm-{second[:32]}.so"  # where the copy used to go
    planted_before = planted.exists()
    if not planted_before:
        planted.write_bytes(b"another user's code")
    try:
        got = tvm_kernels.library_to_map(lib, second)
        assert got != planted and got.read_bytes() == b"second build"
        st = got.parent.stat()
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0
        got.write_bytes(b"tampered")  # a copy whose content is not the digest's is replaced
        assert tvm_kernels.library_to_map(lib, second).read_bytes() == b"second build"
    finally:
        if not planted_before:
            planted.unlink()


def test_a_library_that_does_not_match_its_digest_is_refused(tmp_path, fresh):
    lib = tmp_path / "cpu.so"
    lib.write_bytes(b"what build.json describes")
    digest = _sha(b"what build.json describes")
    lib.write_bytes(b"something else")
    with pytest.raises(ValueError, match="does not match build.json"):
        tvm_kernels.library_to_map(lib, digest)
    assert tvm_kernels._mapped == {}  # nothing was taken as mapped


def test_a_private_directory_others_can_write_is_refused(tmp_path, fresh):
    lib = tmp_path / "cpu.so"
    lib.write_bytes(b"one")
    tvm_kernels.library_to_map(lib, _sha(b"one"))
    lib.write_bytes(b"two")
    folder = tvm_kernels.library_to_map(lib, _sha(b"two")).parent
    os.chmod(folder, 0o777)
    lib.write_bytes(b"three")
    with pytest.raises(PermissionError, match="not a private directory"):
        tvm_kernels.library_to_map(lib, _sha(b"three"))
