"""The artifact writer: layout, manifest, byte-identical output, atomic replacement."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from codegen_helpers import (
    HEAD_DIM,
    HIDDEN,
    KV_HEADS,
    VOCAB,
    checkpoint_tensors,
    forward_batch,
    import_artifact,
    make_program,
)
from kiln.codegen import WeightError, write_artifact
from kiln.compiler import print_program
from kiln.compiler.interpret import interpret
from kiln.dsl.errors import KilnError
from safetensors.torch import load_file

RECIPE = 'recipe tiny { model = tiny_llama(); weights = "hf:./ckpt" }\n'
PASS_LOG = [{"name": "shape_inference", "changed": True}, {"name": "kernel_selection", "changed": True}]
HF_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 512}
MANIFEST_KEYS = {"schema_version", "kiln_version", "recipe_hash", "target", "device", "dtype", "model", "runtime",
                 "kv_cache", "scheduler", "serve", "weights", "tokenizer", "entry", "params", "kernels", "passes",
                 "speculative", "quantization"}


def write(program, out, ckpt, **kw):
    kw = {"recipe_text": RECIPE, "recipe_file": "/somewhere/tiny.dsl", "pass_log": PASS_LOG,
          "kiln_version": "0.0.test", "progress": False, **kw}
    return write_artifact(program, out, checkpoint_dir=ckpt, **kw)


@pytest.fixture
def ckpt(ckpt_factory):
    path = ckpt_factory(config=HF_CONFIG)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4]}))
    write_tokenizer(path, VOCAB)
    (path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return path


def write_tokenizer(path, vocab: int) -> None:
    """A real (word-level) tokenizer.json of `vocab` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def files_of(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_and_byte_identical_rewrites(ckpt, tmp_path):
    program = make_program()
    write(program, tmp_path / "a", ckpt)
    write(program, tmp_path / "b", ckpt)
    a, b = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert sorted(a) == [
        "__init__.py", "__main__.py", "ir.txt", "kernels/__init__.py", "kernels/cpu.py", "kernels/tvm.py",
        "manifest.json", "model.py", "recipe.dsl", "tokenizer/generation_config.json", "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json", "weights/rank0/model-00001-of-00001.safetensors"]
    assert a == b  # every file, byte for byte
    assert a["recipe.dsl"].decode() == RECIPE and a["ir.txt"].decode() == print_program(program)
    assert b"somewhere" not in a["manifest.json"] and str(tmp_path).encode() not in a["manifest.json"]
    assert "kiln 0.0.test" in a["kernels/cpu.py"].decode() and b"def add(" in a["kernels/cpu.py"]
    for name in ("__init__.py", "__main__.py", "kernels/__init__.py", "model.py", "kernels/cpu.py", "kernels/tvm.py"):
        compile(a[name], name, "exec")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_manifest(ckpt, tmp_path):
    program = dataclasses.replace(make_program(), meta={
        "target": "cpu", "kv_cache": {"block_size": 32, "memory_fraction": 0.5},
        "scheduler": {"max_seqs": 8, "policy": "priority"}, "serve": {"max_model_len": 128}})
    manifest = write(program, tmp_path / "art", ckpt)
    assert json.loads((tmp_path / "art/manifest.json").read_text()) == manifest
    assert set(manifest) == MANIFEST_KEYS
    assert manifest["schema_version"] == 2 and manifest["kiln_version"] == "0.0.test"
    assert manifest["recipe_hash"] == hashlib.sha256(RECIPE.encode()).hexdigest()
    assert manifest["target"] == "cpu" and manifest["dtype"] == "float32"
    assert manifest["model"] == {"name": "tiny_llama", "config": dict(program.config)}
    assert manifest["runtime"] == {"vocab_size": VOCAB, "max_model_len": 128, "bos_token_id": 0, "eos_token_ids": [1, 4]}
    assert manifest["kv_cache"] == {
        "num_layers": 2, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": 32, "dtype": "float32",
        "layout": ["num_blocks", 2, "block_size", "kv_heads", "head_dim"], "memory_fraction": 0.5,
        "num_blocks": None, "pool_bytes": 256 * 2**20, "bytes_per_token": 2 * 2 * KV_HEADS * HEAD_DIM * 4}
    # every value explicit (the recipe's, else compiler/options.py's default, else the target's: max_batched_tokens
    # is the cpu target's 2048): the runtime has no defaults
    assert manifest["scheduler"] == {"max_seqs": 8, "max_batched_tokens": 2048, "chunked_prefill": 512,
                                     "policy": "priority", "prefix_cache": "radix", "preemption": "recompute",
                                     "swap_space": 4 * 2**30, "async_scheduling": None}
    assert manifest["serve"] == {"host": "127.0.0.1", "port": 8000, "served_name": None}
    assert manifest["device"] == "cpu" and manifest["speculative"] == {"method": None, "num_tokens": 1}
    w = load_file(str(tmp_path / "art/weights/rank0/model-00001-of-00001.safetensors"))
    shard = "model-00001-of-00001.safetensors"
    assert manifest["weights"] == {
        "dir": "weights/rank0", "files": [shard], "total_bytes": sum(t.numel() * 4 for t in w.values()),
        "sha256": {shard: hashlib.sha256((tmp_path / "art/weights/rank0" / shard).read_bytes()).hexdigest()},
        "tensors": {k: {"file": shard, "dtype": "F32", "shape": list(t.shape)} for k, t in sorted(w.items())},
        "aliases": {}}
    assert manifest["tokenizer"] == {"dir": "tokenizer"}
    assert manifest["entry"] == {"module": "model", "class": "Model"}
    assert manifest["params"][0] == {"name": "embed", "shape": [VOCAB, HIDDEN], "dtype": "float32",
                                     "source": ["model.embed_tokens.weight"]}
    assert manifest["params"][2]["source"][1] == "model.layers.{i}.self_attn.k_proj.weight"
    assert manifest["kernels"] == ["cpu.add", "cpu.add_rms_norm", "cpu.embedding", "cpu.linear", "cpu.logits",
                                   "cpu.paged_attention", "cpu.rms_norm", "cpu.rope", "cpu.silu_mul"]
    assert manifest["passes"] == PASS_LOG
    from kiln.codegen import artifact as codegen_artifact
    from kiln.runtime import manifest as schema

    assert validate_manifest_round_trip(manifest, schema)  # what codegen writes, the runtime's schema reads
    # the version and layouts are the runtime's (codegen may not import it: these must stay equal)
    assert codegen_artifact.SCHEMA_VERSION == schema.SCHEMA_VERSION
    assert (codegen_artifact.KV_LAYOUT, codegen_artifact.MLA_KV_LAYOUT) == (schema.MHA_LAYOUT, schema.MLA_LAYOUT)


def validate_manifest_round_trip(manifest, schema) -> bool:
    checked = schema.validate_manifest(json.loads(json.dumps(manifest)))
    return checked.schema_version == schema.SCHEMA_VERSION and checked.kv_cache.layout == manifest["kv_cache"]["layout"]


@pytest.mark.parametrize("files, message", [
    ({"tokenizer.json": "{ not json"}, r"tokenizer.json: not a tokenizers file"),
    ({"tokenizer.json": '{"model": {}}'}, r"tokenizer.json: not a tokenizers file"),
    ({"tokenizer_config.json": "{,}"}, r"tokenizer_config.json: invalid JSON"),
    ({"tokenizer_config.json": "[]"}, r"tokenizer_config.json: expected a JSON object, got list"),
    ({"tokenizer_config.json": '{"chat_template": "{% for m in messages %}"}'}, r"chat template does not parse"),
    ({"generation_config.json": b"\xff\xfe"}, r"generation_config.json: invalid JSON"),
    ("big", r"tokenizer.json: 200 tokens, more than the model's vocabulary of 96"),
])
def test_a_broken_tokenizer_fails_the_compile_not_the_load(ckpt_factory, tmp_path, files, message):
    path = ckpt_factory(config=HF_CONFIG)
    write_tokenizer(path, 200 if files == "big" else VOCAB)
    for name, text in ({} if files == "big" else files).items():
        (path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(KilnError, match=message):
        write(make_program(), tmp_path / "art", path)
    assert not (tmp_path / "art").exists()


def test_max_model_len_and_defaults(ckpt, tmp_path):
    program = make_program()  # meta is empty; config max_position = 64
    m = write(program, tmp_path / "a", ckpt)
    assert m["runtime"]["max_model_len"] == 64 and m["kv_cache"]["block_size"] == 16
    assert m["kv_cache"]["memory_fraction"] == 0.9 and m["target"] == "cpu"
    assert write(program, tmp_path / "b", ckpt, max_model_len=40)["runtime"]["max_model_len"] == 40
    assert "MAX_MODEL_LEN = 40" in (tmp_path / "b/model.py").read_text()
    no_pos = dataclasses.replace(program, config={k: v for k, v in program.config.items() if k != "max_position"})
    assert write(no_pos, tmp_path / "c", ckpt)["runtime"]["max_model_len"] == 512  # checkpoint config
    assert write(no_pos, tmp_path / "d", None)["runtime"]["max_model_len"] == 4096


def test_random_weights_artifact(tmp_path):
    m = write(make_program(dtype="bf16"), tmp_path / "art", None)
    assert m["tokenizer"] is None and m["runtime"]["bos_token_id"] is None and m["runtime"]["eos_token_ids"] == []
    assert m["dtype"] == "bfloat16" and m["kv_cache"]["dtype"] == "bfloat16"
    assert m["kv_cache"]["bytes_per_token"] == 2 * 2 * KV_HEADS * HEAD_DIM * 2
    assert not (tmp_path / "art/tokenizer").exists()


def test_artifact_runs_like_the_interpreter(ckpt, tmp_path):
    program = make_program()
    write(program, tmp_path / "art", ckpt)
    weights = load_file(str(tmp_path / "art/weights/rank0/model-00001-of-00001.safetensors"))
    model = import_artifact(tmp_path / "art").Model(weights, "cpu")
    tokens = torch.tensor([0, 12, 7, 7, 93, 41, 5])
    kv = [torch.zeros(4, 2, 4, KV_HEADS, HEAD_DIM) for _ in range(2)]
    got = model.forward(forward_batch(tokens, 0, [3, 1], 4), kv)
    torch.testing.assert_close(got, interpret(program, weights, tokens), atol=1e-5, rtol=1e-5)
    ref = checkpoint_tensors()["model.embed_tokens.weight"]
    assert torch.equal(weights["embed"], ref)


def test_failed_compile_leaves_nothing(ckpt_factory, tmp_path):
    tensors = checkpoint_tensors()
    del tensors["lm_head.weight"]
    with pytest.raises(WeightError, match="lm_head.weight"):
        write(make_program(), tmp_path / "art", ckpt_factory(tensors=tensors))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_recompiling_replaces_an_artifact_but_never_a_foreign_directory(ckpt, tmp_path):
    write(make_program(layers=2), tmp_path / "art", ckpt)
    m = write(make_program(layers=1), tmp_path / "art", ckpt)
    assert m["kv_cache"]["num_layers"] == 1
    assert json.loads((tmp_path / "art/manifest.json").read_text())["kv_cache"]["num_layers"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    (tmp_path / "home").mkdir()
    (tmp_path / "home/notes.txt").write_text("keep me")
    with pytest.raises(KilnError, match="not a kiln artifact; refusing"):
        write(make_program(), tmp_path / "home", ckpt)
    assert (tmp_path / "home/notes.txt").read_text() == "keep me"


def test_main_calls_the_cli(tmp_path):
    write(make_program(), tmp_path / "art", None)
    main = (tmp_path / "art/__main__.py").read_text()
    assert "from kiln.runtime.entrypoint import artifact_main" in main and "artifact_main(HERE, sys.argv[1:])" in main


def test_codegen_never_imports_the_runtime():
    from pathlib import Path

    import kiln.codegen

    for path in Path(kiln.codegen.__file__).parent.glob("*.py"):
        assert "kiln.runtime" not in path.read_text(), f"{path.name} imports kiln.runtime (layering)"
