"""`kiln serve` on a non-loopback address without --api-key prints one warning line; loopback or a key: none."""
from __future__ import annotations

import pytest
from kiln.runtime.launch import exposure_warning


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "[::]", "my-host.example"])
def test_exposed_without_a_key_warns(host):
    line = exposure_warning(host, None)
    assert line is not None and "\n" not in line
    assert host in line and "--api-key" in line and "WARNING" in line


@pytest.mark.parametrize("host, key", [("127.0.0.1", None), ("localhost", None), ("::1", None), ("[::1]", None),
                                       ("127.0.0.2", None), ("0.0.0.0", "secret"), ("::", "k")])
def test_loopback_or_a_key_is_quiet(host, key):
    assert exposure_warning(host, key) is None
