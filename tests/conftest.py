"""Shared fixtures: tiny random Hugging Face checkpoints, built offline once per test session."""

from __future__ import annotations

import importlib.util
import pathlib
import tempfile
from collections.abc import Callable

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load_examples_module(name: str):
    # examples/ is data, not a package: import the script by path
    spec = importlib.util.spec_from_file_location(f"kiln_examples_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint_lib():
    """The examples/make_tiny_checkpoint.py module (build_tiny_checkpoint, load_hf_model, ARCHS, ...)."""
    pytest.importorskip("transformers")
    return _load_examples_module("make_tiny_checkpoint")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_lib, tmp_path_factory) -> Callable[..., pathlib.Path]:
    """Factory `tiny_checkpoint(arch="llama", **kw) -> Path`; each distinct (arch, kw) is built once per session.

    kw are build_tiny_checkpoint's keywords: seed, num_shards, dtype, legacy_config, config overrides.
    Treat the returned directory as read-only: other tests share it.
    """
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    cache: dict[tuple, pathlib.Path] = {}

    def make(arch: str = "llama", **kw) -> pathlib.Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            out = root / f"{arch}-{len(cache)}"
            cache[key] = tiny_checkpoint_lib.build_tiny_checkpoint(out, arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def compile_hf(tiny_checkpoint, tmp_path_factory):
    """Factory `compile_hf(arch, *, edits=(), **kw) -> (checkpoint, artifact dir, CompileResult)`.

    The checkpoint's recipe comes from `kiln recipe from-hf`, rewritten by `edits` ((old, new) text
    replacements, each of which must apply), then `kiln.compile`d — once per session per distinct call.
    """
    import kiln
    from kiln.cli import main

    root = tmp_path_factory.mktemp("compiled")
    cache: dict[tuple, tuple] = {}

    def build(arch: str, *, edits: tuple[tuple[str, str], ...] = (), **kw):
        key = (arch, edits, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            ckpt = tiny_checkpoint(arch, **kw)
            work = pathlib.Path(tempfile.mkdtemp(prefix=f"{arch}-", dir=root))  # unique even after a build that raised
            recipe = work / "recipe.dsl"
            assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
            text = recipe.read_text()
            for old, new in edits:
                assert old in text, f"edit {old!r} does not apply to the generated recipe"
                text = text.replace(old, new, 1)
            recipe.write_text(text)
            cache[key] = (ckpt, work / "art", kiln.compile(recipe, work / "art", progress=False))
        return cache[key]

    return build


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoint_lib):
    """`hf_reference(ckpt, prompt, new_tokens)` -> (HF log-prob of each next prompt token, HF greedy tokens),
    from a plain greedy loop over full sequences (no KV cache), cached per checkpoint and prompt."""
    import torch

    models: dict[str, object] = {}
    cache: dict[tuple, tuple] = {}

    @torch.no_grad()
    def ref(ckpt, prompt: list[int], new_tokens: int):
        key = (str(ckpt), tuple(prompt), new_tokens)
        if key not in cache:
            model = models.setdefault(str(ckpt), tiny_checkpoint_lib.load_hf_model(ckpt))
            ids = torch.tensor([prompt])
            logp = model(ids).logits[0].float().log_softmax(-1)
            out = list(prompt)
            for _ in range(new_tokens):
                out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
            cache[key] = (logp[:-1].gather(1, ids[0, 1:, None])[:, 0], out[len(prompt):])
        return cache[key]

    return ref


@pytest.fixture(scope="session")
def check_prompt_parity(hf_reference):
    """`check_prompt_parity(artifact, ckpt, prompt, new_tokens)`: `kiln.LLM(artifact)` on one prompt: fp32 prompt
    logprobs within 1e-4 of HF's, its `new_tokens` greedy tokens identical to HF's."""
    import torch

    import kiln

    def check(artifact, ckpt, prompt: list[int], new_tokens: int) -> None:
        params = kiln.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        out = kiln.LLM(str(artifact)).generate([prompt], params)[0]
        ref_lp, ref_tokens = hf_reference(ckpt, prompt, new_tokens)
        ours = torch.tensor([out.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt) if j > 0])
        torch.testing.assert_close(ours, ref_lp, atol=1e-4, rtol=0)
        assert out.outputs[0].token_ids == ref_tokens, f"{artifact}: greedy tokens differ from HF"

    return check


@pytest.fixture(scope="session")
def check_hf_parity(hf_reference):
    """`check_hf_parity(artifact, ckpt, vocab)`: prompts of 5, 17 and 40 random tokens, run as one batch by
    `kiln.LLM`: fp32 prompt logprobs within 1e-4 of HF, 32 greedy tokens identical to HF's, and each prompt
    run alone gives the batch's tokens and logprobs."""
    import torch

    import kiln

    def check(artifact, ckpt, vocab: int, *, new_tokens: int = 32, lens: tuple[int, ...] = (5, 17, 40),
              **llm_kwargs) -> None:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lens]
        llm = kiln.LLM(str(artifact), **llm_kwargs)
        params = kiln.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            ref_lp, ref_tokens = hf_reference(ckpt, prompt, new_tokens)
            assert out.prompt_logprobs[0] is None
            ours = torch.tensor([out.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt) if j > 0])
            torch.testing.assert_close(ours, ref_lp, atol=1e-4, rtol=0)
            assert out.outputs[0].token_ids == ref_tokens, f"{artifact}: greedy tokens differ from HF"
            alone = llm.generate([prompt], params)[0]
            assert alone.outputs[0].token_ids == out.outputs[0].token_ids
            alone_lp = [alone.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt) if j > 0]
            torch.testing.assert_close(torch.tensor(alone_lp), ours, atol=1e-5, rtol=0)

    return check


@pytest.fixture(scope="session")
def run_engine():
    """`run_engine(engine, prompts, max_tokens, logprobs=1)`: greedy requests ("0", "1", …) through
    `LLMEngine.step()` until all finish; returns their final RequestOutputs in prompt order."""
    from kiln.runtime.sampling_params import SamplingParams

    def run(engine, prompts: list[list[int]], max_tokens: list[int], logprobs: int = 1):
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                         logprobs=logprobs))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[str(i)] for i in range(len(prompts))]

    return run
