"""Artifact loading: package import of the generated code, weights, manifest checks."""
from __future__ import annotations

import json

import pytest
import torch
from kiln.runtime import ArtifactError
from kiln.runtime.artifact import load_artifact


def test_loads_model_weights_and_tokenizer(artifact_dir):
    art = load_artifact(artifact_dir)
    assert art.model.num_layers == 2 and art.tokenizer is not None
    assert art.kv_cache_config.block_size == 4 and art.kv_cache_config.dtype == torch.float32
    assert art.scheduler_config.prefix_cache == "radix" and art.model_config.eos_token_ids == (2,)
    other = load_artifact(artifact_dir)  # a second load gets its own package: no shared module state
    assert type(other.model).__module__ != type(art.model).__module__


def test_schema_version_refused(artifact_copy):
    path = artifact_copy(lambda m: m.__setitem__("schema_version", 1))  # an artifact of an older kiln
    with pytest.raises(ArtifactError, match="schema version 1.*Recompile"):
        load_artifact(path)


@pytest.mark.parametrize("breakage, message", [
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    (lambda p: (p / "manifest.json").write_text("{oops"), "invalid JSON"),
    (lambda p: (p / "weights" / "rank0" / "model.safetensors").unlink(), "missing"),
    (lambda p: (p / "model.py").write_text("raise RuntimeError('boom')"), "boom"),
    (lambda p: (p / "__init__.py").unlink(), "importable as a package"),
    (lambda p: _edit(p, lambda m: m["entry"].__setitem__("class", "Nope")), "no class Nope"),
    (lambda p: _edit(p, lambda m: m["kv_cache"].__setitem__("dtype", "int3")), "kv_cache.dtype: Input should be .float32."),
])
def test_broken_artifacts_raise_artifact_error(artifact_copy, breakage, message):
    path = artifact_copy()
    breakage(path)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path).kv_cache_config  # noqa: B018


def _edit(path, fn):
    manifest = json.loads((path / "manifest.json").read_text())
    fn(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------- weights are the ones compiled (issue 10.8, 10.9)

WEIGHTS = "weights/rank0/model.safetensors"


def _rewrite_weights(path, fn, *, update_manifest: bool = False):
    """Replaces the weight file by `fn(tensors)`; with `update_manifest`, records the new file's sha256 (as a
    careless hand edit of the artifact would), so that only the tensor check can catch it."""
    from kiln.codegen.artifact import weights_index
    from safetensors.torch import load_file, save_file

    tensors = fn(load_file(str(path / WEIGHTS)))
    save_file(tensors, str(path / WEIGHTS))
    if update_manifest:
        _edit(path, lambda m: m["weights"].update(sha256=weights_index(path / "weights" / "rank0",
                                                                       ["model.safetensors"])["sha256"]))


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all" * 8, "half"])
@pytest.mark.parametrize("digest_updated, message", [
    (False, "model.safetensors: the file is not the one compiled.*recompile"),
    # a manifest whose digest was edited to match the broken file: safetensors' error, as an ArtifactError
    (True, "model.safetensors: not a readable safetensors file"),
])
def test_truncated_empty_or_garbage_weights_are_refused(artifact_copy, content, digest_updated, message):
    import hashlib

    path = artifact_copy()
    file = path / WEIGHTS
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if content == "half" else content)
    if digest_updated:
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        _edit(path, lambda m: m["weights"].update(sha256={"model.safetensors": digest}))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path)


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "norm": t["norm"].double()}, r"tensor 'norm' is F64 \[64\], manifest.json .* expect F32 \[64\]"),
    (lambda t: {**t, "norm": t["norm"][:32].clone()}, r"tensor 'norm' is F32 \[32\].* expect F32 \[64\]"),
    (lambda t: {k: v for k, v in t.items() if k != "lm_head"}, r"missing \['lm_head'\]"),
    (lambda t: {**t, "extra": t["norm"].clone()}, r"unexpected \['extra'\]"),
])
def test_weights_checked_against_the_manifest(artifact_copy, change, message):
    path = artifact_copy()
    _rewrite_weights(path, change, update_manifest=True)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path)


def test_replaced_weight_file_is_refused_by_its_digest(artifact_copy):
    path = artifact_copy()
    _rewrite_weights(path, lambda t: {**t, "norm": t["norm"] * 2})  # same names, dtypes, shapes
    with pytest.raises(ArtifactError, match="sha256"):
        load_artifact(path)


def test_compiled_manifest_records_digest_and_tensors(compiled_random):
    """kiln compile records what the loader checks: a sha256 per weight file, and each tensor's dtype and shape."""
    import hashlib

    from safetensors import safe_open

    art, manifest = compiled_random
    w = manifest["weights"]
    for name in w["files"]:
        assert hashlib.sha256((art / w["dir"] / name).read_bytes()).hexdigest() == w["sha256"][name]
        with safe_open(str(art / w["dir"] / name), framework="pt") as f:
            names = list(f.keys())
        assert sorted(names) == sorted(t for t, m in w["tensors"].items() if m["file"] == name)
    assert w["tensors"]["embed"] == {"file": w["files"][0], "dtype": "F32", "shape": [64, 32]}


# ---------------------------------------------------------------- one manifest schema (issue 10.10)

@pytest.mark.parametrize("edit, message", [
    (lambda m: m["kv_cache"].__setitem__("block_size", 0), r"kv_cache.block_size: Input should be greater than or equal to 1"),
    (lambda m: m["kv_cache"].__setitem__("block_size", 6), r"kv_cache.block_size: must be a power of two"),
    (lambda m: m["scheduler"].__setitem__("max_seqs", 0), r"scheduler.max_seqs: .*greater than or equal to 1"),
    (lambda m: m["scheduler"].__setitem__("max_batched_tokens", "many"), r"scheduler.max_batched_tokens"),
    (lambda m: m["runtime"].__setitem__("vocab_size", -3), r"runtime.vocab_size"),
    (lambda m: m["runtime"].__setitem__("eos_token_ids", [10**6]), r"eos_token_ids \[1000000\] outside the vocabulary"),
    (lambda m: m["kv_cache"].__setitem__("memory_fraction", 1.5), r"kv_cache.memory_fraction"),
    (lambda m: m["kv_cache"].__setitem__("layout", ["num_blocks", "block_size"]), r"kv_cache: .*layout"),
    (lambda m: m["kv_cache"].pop("num_layers"), r"kv_cache.num_layers: Field required"),
    (lambda m: m["weights"].__setitem__("dir", "../../elsewhere"), r"weights.dir: .*relative path inside"),
    (lambda m: m["weights"].__setitem__("files", ["/etc/passwd"]), r"weights.files.0: must be a plain file name"),
    (lambda m: m["tokenizer"].__setitem__("dir", "/tmp"), r"tokenizer.dir"),
    (lambda m: m["entry"].__setitem__("module", "os.path"), r"entry.module: must be a Python identifier"),
    (lambda m: m.__setitem__("device", "tpu"), r"device: Input should be 'cpu' or 'cuda'"),
    (lambda m: m["scheduler"].pop("swap_space"), r"scheduler.swap_space: Field required"),  # no runtime defaults
    (lambda m: m.pop("serve"), r"serve: Field required"),
])
def test_manifest_is_validated_against_one_schema(artifact_copy, edit, message):
    path = artifact_copy(edit)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path)


def test_manifest_max_model_len_beyond_the_rotary_tables_is_refused(compiled_random, tmp_path):
    art = _copy(compiled_random[0], tmp_path)
    _edit(art, lambda m: m["runtime"].__setitem__("max_model_len", 10**6))
    with pytest.raises(ArtifactError, match=r"max_model_len = 1000000, but model.py was generated for at most 128"):
        load_artifact(art)


def test_manifest_vocab_size_larger_than_the_embedding_is_refused(compiled_random, tmp_path):
    art = _copy(compiled_random[0], tmp_path)
    _edit(art, lambda m: m["runtime"].__setitem__("vocab_size", 100))
    with pytest.raises(ArtifactError, match=r"vocab_size = 100, but the model's logits have 64 rows"):
        load_artifact(art)


def test_garbage_tokenizer_in_an_artifact_is_an_artifact_error(artifact_copy):
    path = artifact_copy()
    (path / "tokenizer" / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ArtifactError, match="the tokenizer does not load"):
        load_artifact(path)


def _copy(src, tmp_path):
    import shutil

    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def compiled_random(tmp_path_factory):
    """A small random-weight artifact from `kiln compile` (its model.py has the constants the loader checks)."""
    import kiln

    work = tmp_path_factory.mktemp("compiled_random")
    recipe = work / "r.dsl"
    recipe.write_text("recipe r {\n  model = llama(vocab=64, hidden=32, layers=1, heads=2, ffn=64, max_position=128)\n"
                      "  weights = random(seed=0)\n}\n")
    res = kiln.compile(recipe, work / "art", progress=False)
    return work / "art", res.manifest
