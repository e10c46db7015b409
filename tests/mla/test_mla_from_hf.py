"""`kiln recipe from-hf` for DeepSeek: the MLA config it writes, and what it refuses with a clear message."""
from __future__ import annotations

import json

import pytest

from kiln.recipe_from_hf import UnsupportedCheckpoint, recipe_from_hf

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "q_lora_rank": 24, "kv_lora_rank": 32,
      "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 2,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_interleave": True}


def _recipe(tmp_path, **changes):
    (tmp_path / "config.json").write_text(json.dumps({**V3, **changes}))
    return recipe_from_hf(tmp_path)


def test_v3_and_v2_configs(tmp_path):
    text = _recipe(tmp_path)
    assert "deepseek_v3(" in text and "q_lora_rank=24" in text and "kv_lora_rank=32" in text
    assert "rope_interleave=true" in text
    v2 = _recipe(tmp_path, architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None, rope_interleave=None)
    assert "q_lora_rank=0" in v2 and "rope_interleave=true" in v2


def test_refuses_rope_scalings_other_than_yarn_clearly(tmp_path):  # yarn: tests/facade/test_rope_yarn.py
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 4096}
    with pytest.raises(UnsupportedCheckpoint, match="DeepSeek rope scaling 'longrope' is not supported yet"):
        _recipe(tmp_path, rope_parameters=longrope)
    with pytest.raises(UnsupportedCheckpoint, match=r"'dynamic' \(NTK\) rope scaling is not supported"):
        _recipe(tmp_path, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})


def test_moe_layers_need_their_expert_config(tmp_path):  # MoE args: tests/moe/test_deepseek_moe_parity.py
    with pytest.raises(UnsupportedCheckpoint, match="needs n_routed_experts"):
        _recipe(tmp_path, first_k_dense_replace=1)
