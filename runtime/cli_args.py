"""Argument types and shared flags of the runtime's command lines (`kiln serve`, `kiln router`, an artifact's own
entry point): ports, counts, byte sizes, CPU lists, effort tables, and the control plane's security flags."""
from __future__ import annotations

import argparse

from .errors import RequestError
from .thinking import parse_effort_budgets
from .threads import parse_cpu_list


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (an integer in 1..65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range: a port is an integer in 1..65535")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give at least 1")
    return value


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def cpu_list(text: str) -> list[int]:
    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def byte_size(text: str) -> int:
    """A byte size: 16GiB, 512MiB, 2GB, 1048576; 0 or none: off."""
    if text.strip().lower() == "none":
        return 0
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].upper()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (such as 16GiB, 512MiB or 0)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is not negative")
    return int(value)


def add_security_args(p: argparse.ArgumentParser) -> None:
    """The control and KV planes' security (runtime/ipc/curve.py), for `kiln serve` and `kiln router`."""
    p.add_argument("--curve-keys", metavar="DIR",
                   help="authenticate and encrypt every TCP control and KV socket with the CURVE keys in DIR (`kiln "
                   "keys generate DIR`; the same DIR on every machine); also KILN_CURVE_KEYS=DIR (default: none)")
    p.add_argument("--insecure", action="store_true",
                   help="without --curve-keys, listen on an address other than loopback anyway, unauthenticated "
                   "(only on a network you trust; default: refused)")


def effort_table(text: str) -> dict[str, int]:

    try:
        return parse_effort_budgets(text)
    except RequestError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
