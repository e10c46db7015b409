"""examples/make_tiny_checkpoint.py builds real, reloadable HF checkpoints with non-trivial weights."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "llama3_rope", "llama_tied", "llama_head_dim", "mistral", "qwen2", "qwen3"]


def _tensor_names(path) -> set[str]:
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def _tensor(path, name) -> torch.Tensor:
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names = f.keys()
            if name in names:
                return f.get_tensor(name)
    raise KeyError(name)


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_builds_and_reloads(tiny_checkpoint, tiny_checkpoint_lib, arch):
    path = tiny_checkpoint(arch)
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").is_file()

    model = tiny_checkpoint_lib.load_hf_model(path)
    assert not model.training and model.config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    logits = model(torch.tensor([[0, 10, 20, 30]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.1  # spread out, so greedy parity tests have no near-ties

    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 512)
    names = _tensor_names(path)
    # norms are random, so a compiler that skips one cannot match HF
    assert not torch.allclose(_tensor(path, "model.norm.weight"), torch.ones(64))
    assert not torch.allclose(_tensor(path, "model.layers.0.input_layernorm.weight"), torch.ones(64))
    assert "model.embed_tokens.weight" in names


def test_tied_has_no_lm_head(tiny_checkpoint, tiny_checkpoint_lib):
    path = tiny_checkpoint("llama_tied")
    assert "lm_head.weight" not in _tensor_names(path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    model = tiny_checkpoint_lib.load_hf_model(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" in _tensor_names(tiny_checkpoint("llama"))


def test_llama_gqa_and_head_dim(tiny_checkpoint):
    names = _tensor_names(tiny_checkpoint("llama"))
    assert _tensor(tiny_checkpoint("llama"), "model.layers.0.self_attn.k_proj.weight").shape == (32, 64)
    assert not any(n.endswith(".bias") for n in names)
    path = tiny_checkpoint("llama_head_dim")
    assert json.loads((path / "config.json").read_text())["head_dim"] == 32
    assert _tensor(path, "model.layers.0.self_attn.q_proj.weight").shape == (4 * 32, 64)
    assert _tensor(path, "model.layers.0.self_attn.o_proj.weight").shape == (64, 4 * 32)


def test_qwen2_has_nonzero_qkv_bias(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    for proj in ["q_proj", "k_proj", "v_proj"]:
        assert _tensor(path, f"model.layers.1.self_attn.{proj}.bias").abs().max() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in _tensor_names(path)


def test_qwen3_has_nontrivial_qk_norm(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    for norm in ["q_norm", "k_norm"]:
        weight = _tensor(path, f"model.layers.0.self_attn.{norm}.weight")
        assert weight.shape == (16,) and not torch.allclose(weight, torch.ones(16))


def test_llama3_rope_scaling_is_in_config_and_matters(tiny_checkpoint, tiny_checkpoint_lib):
    path = tiny_checkpoint("llama3_rope")
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"  # transformers 5 layout
    assert config["max_position_embeddings"] == 256
    legacy = json.loads((tiny_checkpoint("llama3_rope", legacy_config=True) / "config.json").read_text())
    assert legacy["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in legacy
    assert legacy["rope_theta"] == config["rope_parameters"]["rope_theta"]

    model = tiny_checkpoint_lib.load_hf_model(path)
    ids = torch.randint(5, 512, (1, 100), generator=torch.Generator().manual_seed(0))
    scaled = model(ids).logits
    plain = tiny_checkpoint_lib.load_hf_model(path)
    plain.config.rope_parameters = {
        "rope_type": "default",
        "rope_theta": config["rope_parameters"]["rope_theta"],
    }
    plain.model.rotary_emb = type(plain.model.rotary_emb)(plain.config)
    assert not torch.allclose(scaled, plain(ids).logits, atol=1e-3)


def test_mistral_sliding_window_applies_in_eager(tiny_checkpoint, tiny_checkpoint_lib):
    path = tiny_checkpoint("mistral")
    model = tiny_checkpoint_lib.load_hf_model(path)
    window = model.config.sliding_window
    assert window == 16
    ids = torch.randint(5, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    windowed = model(ids).logits
    model.config.sliding_window = None
    full = model(ids).logits
    torch.testing.assert_close(windowed[:, :window], full[:, :window], rtol=0, atol=0)
    assert not torch.allclose(windowed[:, window], full[:, window])  # position W no longer sees key 0


def test_sharded_checkpoint(tiny_checkpoint, tiny_checkpoint_lib):
    path = tiny_checkpoint("llama", num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) == 3 and not (path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    # same seed, same weights as the unsharded build
    sharded = tiny_checkpoint_lib.load_hf_model(path)
    single = tiny_checkpoint_lib.load_hf_model(tiny_checkpoint("llama"))
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_checkpoint_dtype(tiny_checkpoint):
    path = tiny_checkpoint("llama", dtype=torch.bfloat16, num_hidden_layers=1)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert _tensor(path, "model.norm.weight").dtype == torch.bfloat16


def test_tokenizer_round_trip_and_special_ids(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) <= config["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert config["eos_token_id"] in generation["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]

    for text in ["The kiln was glowing orange.", 'héllo wörld — 123 {"k": [1, 2]}\n\ttabs', "zebra quartz"]:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and max(ids) < config["vocab_size"]
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok("The kiln was glowing orange.").input_ids) < 15  # BPE merges learned from the corpus

    # the raw tokenizers file agrees (what kiln's runtime loads)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert raw.encode("The kiln").ids == tok("The kiln").input_ids


def test_chat_template_in_tokenizer_config(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_config and not (path / "chat_template.jinja").exists()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_script_entry_point(tmp_path, monkeypatch, capsys):
    """The script run as `python examples/make_tiny_checkpoint.py OUT --arch qwen3 --shards 2` (its `__main__` block
    and argument parsing, run in this interpreter: a fresh one would spend its time importing torch)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_checkpoint.py"
    out = tmp_path / "ckpt"
    monkeypatch.setattr(sys, "argv", [str(script), str(out), "--arch", "qwen3", "--shards", "2"])
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip().endswith(str(out))
    assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"


def test_unknown_arch(tiny_checkpoint_lib, tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        tiny_checkpoint_lib.build_tiny_checkpoint(tmp_path, "gpt2")
