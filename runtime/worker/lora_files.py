"""The files of an adapter a client names at run time: confined to the server's `--lora-roots`, read only when
they are regular files of bounded size (a FIFO or a device would block or fill the engine core's loop)."""
from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ..errors import KilnRuntimeError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
CONFIG_MAX_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes


class AdapterFileError(KilnRuntimeError):
    """An adapter file that is not read: outside the roots, not a regular file, or too large."""


def read_bounded(file: Path, max_bytes: int) -> bytes:
    """The bytes of `file`, a regular file of at most `max_bytes` (AdapterFileError otherwise; FileNotFoundError
    when it does not exist). Opened without blocking and checked on the open descriptor, so a FIFO, a device or a
    file swapped in after a check is refused before anything is read."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AdapterFileError(f"{file}: not a regular file")
        if st.st_size > max_bytes:
            raise AdapterFileError(f"{file}: {st.st_size} bytes, above the {max_bytes} an adapter of this "
                                   "artifact can need")
        chunks, left = [], st.st_size + 1  # one byte more: a file that grew since fstat is refused too
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise AdapterFileError(f"{file}: grew past {max_bytes} bytes while it was read")
        return data
    finally:
        os.close(fd)


def resolve_roots(roots: Sequence[str | Path]) -> tuple[Path, ...]:
    """`--lora-roots`, resolved; each must be a directory (AdapterFileError)."""
    resolved = []
    for root in roots:
        path = Path(root).expanduser().resolve()
        if not path.is_dir():
            raise AdapterFileError(f"--lora-roots {root}: not a directory")
        resolved.append(path)
    return tuple(resolved)


def confine(path: str | Path, roots: Sequence[Path]) -> Path:
    """`path` with every symlink resolved, refused (AdapterFileError) unless it and the adapter files in it lie
    under one of `roots` (resolved directories). A relative path is taken relative to the first root."""
    given = Path(path)
    if not given.is_absolute():
        given = roots[0] / given
    resolved = given.resolve()

    def inside(p: Path) -> bool:
        return any(p == root or p.is_relative_to(root) for root in roots)

    if not inside(resolved):
        raise AdapterFileError(f"lora_path {str(path)!r} is outside the server's --lora-roots")
    for entry in (resolved / CONFIG_FILE, resolved / WEIGHTS_FILE):
        if not inside(entry.resolve()):
            raise AdapterFileError(f"lora_path {str(path)!r}: {entry.name} links outside the server's --lora-roots")
    return resolved
