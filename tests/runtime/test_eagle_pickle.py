"""EAGLE heads in pytorch_model.bin (pickle) form: read only by a torch whose torch.load(weights_only=True) is not
affected by CVE-2025-32434 (>= 2.6); an older torch refuses the file with a clear error. safetensors always reads."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime.core.speculative import eagle_head


@pytest.mark.parametrize("version, safe", [("2.4.1", False), ("2.5.1+cpu", False), ("2.6.0", True),
                                           ("2.6.0a0+git1234", True), ("2.10.1", True), ("3.0", True),
                                           ("1.13.1", False), ("garbage", False)])
def test_pickle_safe_torch(version, safe):
    assert eagle_head.pickle_safe_torch(version) is safe


def test_a_bin_head_is_refused_on_an_affected_torch(tmp_path, monkeypatch):
    torch.save({"fc.weight": torch.zeros(2, 4)}, tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(ValueError, match=r"pickle.*CVE-2025-32434.*model\.safetensors"):
        eagle_head.weights_file(tmp_path)
    with pytest.raises(ValueError, match="CVE-2025-32434"):
        eagle_head.read_weights(tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    assert eagle_head.weights_file(tmp_path) == tmp_path / "pytorch_model.bin"
    assert eagle_head.read_weights(tmp_path)["fc.weight"].shape == (2, 4)


def test_a_safetensors_head_reads_on_any_torch(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(2, 4)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(torch, "__version__", "2.4.0")
    assert eagle_head.read_weights(tmp_path)["fc.weight"].shape == (2, 4)
