"""Embedding artifacts (task = embed) equal transformers + the sentence-transformers pooling config, by hand."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kiln.runtime.errors import RequestError  # noqa: E402

import kiln  # noqa: E402
from kiln.cli import main  # noqa: E402

PROMPTS = [[1, 2, 3], list(range(5, 40)), [7] * 17, list(range(100, 130)), [9]]


def _reference(ckpt, pooling: str, normalize: bool) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            h = model(torch.tensor([p])).last_hidden_state[0]
            v = h[-1] if pooling == "last" else h.mean(dim=0)
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


@pytest.mark.parametrize("pooling,normalize,chunk", [("last", True, 512), ("mean", True, 512), ("mean", False, 8),
                                                     ("last", False, 8)])
def test_llm_embed_equals_transformers(tmp_path, build_embed, pooling, normalize, chunk):
    ckpt, art = build_embed(tmp_path, pooling, normalize, chunk)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["task"] == "embed"
    assert manifest["embedding"] == {"pooling": pooling, "normalize": normalize, "hidden": 64, "matryoshka": None}
    with kiln.LLM(str(art), max_num_batched_tokens=16 if chunk == 8 else None) as llm:
        ours = llm.embed(PROMPTS)
        with pytest.raises(RequestError, match="Matryoshka"):
            llm.embed(PROMPTS[:1], dimensions=8)
        with pytest.raises(RequestError, match="embedding model"):
            llm.generate([PROMPTS[0]])
    for o, ref in zip(ours, _reference(ckpt, pooling, normalize), strict=True):
        o = torch.tensor(o)
        assert torch.nn.functional.cosine_similarity(o, ref, dim=0).item() >= 0.99999
        torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


def test_generation_artifact_has_no_embeddings(compile_hf):
    _, art, _ = compile_hf("llama")
    with kiln.LLM(str(art)) as llm, pytest.raises(RequestError, match="no embeddings"):
        llm.embed([[1, 2, 3]])


def test_embed_on_a_mesh_is_refused_at_its_place(tmp_path, tiny_checkpoint_lib):
    from kiln.dsl.errors import SourceError

    ckpt = tiny_checkpoint_lib.build_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    text = recipe.read_text().replace("  dtype   = fp32\n", "  dtype   = fp32\n  task    = embed\n"
                                      "  parallel { tp = 2 }\n", 1)
    recipe.write_text(text)
    with pytest.raises(SourceError, match="task = embed on a parallel mesh") as e:
        kiln.compile(recipe, tmp_path / "art", progress=False)
    assert "r.dsl:" in e.value.format()


def test_recipe_from_hf_reads_task_from_modules_json(tmp_path, tiny_checkpoint_lib, sentence_transformers_config):
    from kiln.recipe_from_hf import recipe_from_hf

    ckpt = tiny_checkpoint_lib.build_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    assert "task    =" not in recipe_from_hf(ckpt)  # no modules.json: a generation model
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]))
    assert "task    =" not in recipe_from_hf(ckpt)  # no Pooling module
    (ckpt / "modules.json").write_text("{not json")
    assert "task    =" not in recipe_from_hf(ckpt)
    sentence_transformers_config(ckpt, "last", True)
    text = recipe_from_hf(ckpt)
    assert text.count("\n  task    = embed\n") == 1
    assert "  # task = embed: modules.json lists a sentence-transformers Pooling module" in text
