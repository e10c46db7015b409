"""LLM: the offline, batch-generation facade over LLMEngine (vLLM's `LLM` shape): the engine core in-process."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from .core.engine import EngineCore
from .embedding import check_dimensions, embedding_section, shape
from .errors import RequestError
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

Prompt = str | list[int] | dict


class LLM:
    """`LLM("build/llama").generate(["Hello", "Hi"], SamplingParams(max_tokens=8))`.

    A prompt is text (tokenized with the artifact's tokenizer), a list of token ids, or a dict with
    `prompt` or `prompt_token_ids`. Outputs come back in input order, finished. A parallel artifact starts one
    worker process per rank > 0 (`executor="local"`: all ranks in this process); `close()` (or `with LLM(...)`)
    stops them.
    """

    def __init__(self, artifact_dir: str | Path, *, num_kv_blocks: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 seed: int = 0, **engine_kwargs: Any) -> None:
        engine_kwargs.setdefault("output_kind", "final")  # generate() returns finished outputs only
        self.engine = LLMEngine(artifact_dir, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Stops what runs the model (a parallel artifact's rank workers); the LLM cannot generate afterwards."""
        self.engine.runner.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 lora: str | Seq[str | None] | None = None) -> list[RequestOutput]:
        """`lora`: the LoRA adapter every prompt decodes with, or one per prompt (None: the base model)."""
        if self.engine.pooler is not None:
            raise RequestError("this artifact is an embedding model (task = embed): use LLM.embed, not generate")
        prompt_list = _as_prompt_list(prompts)
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise RequestError(f"{len(loras)} LoRA adapters for {len(prompt_list)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise RequestError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        requests = [(str(next(self._request_ids)), *self._tokenize(p), sp, name)
                    for p, sp, name in zip(prompt_list, params_list, loras)]
        return self._run(requests)

    def embed(self, prompts: Prompt | Seq[Prompt], *, dimensions: int | None = None) -> list[list[float]]:
        """One embedding per prompt, in order, from an embedding artifact (`task = embed`, docs/embeddings.md):
        the pooled final hidden state, normalized as the checkpoint's sentence-transformers config says;
        `dimensions` (Matryoshka models): the first d values, normalized again."""
        section = embedding_section(self.engine.artifact.manifest)
        if section is None:
            raise RequestError("this artifact generates text (no task = embed): it has no embeddings")
        check_dimensions(section, dimensions)
        engine, params = self.engine, SamplingParams(max_tokens=1)
        prompt_list = _as_prompt_list(prompts)
        ids = [str(next(self._request_ids)) for _ in prompt_list]
        results: dict[str, list[float]] = {}
        try:
            for request_id, prompt in zip(ids, prompt_list):
                EngineCore.add_request(engine, request_id, self._tokenize(prompt)[1], params)
            while len(results) < len(ids):
                for delta in EngineCore.step(engine):
                    if delta.error is not None:
                        raise RequestError(delta.error)
                    if delta.embedding is not None:
                        results[delta.request_id] = shape(delta.embedding, section, dimensions)
        finally:
            for request_id in ids:
                EngineCore.end_request(engine, request_id, "abort")
        return [results[request_id] for request_id in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             *, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered with the
        tokenizer's chat template and tokenized without adding special tokens (the template has them)."""
        tokenizer = self._require_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 **template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params)

    def _run(self, requests: list[tuple[str, str | None, list[int], SamplingParams, str | None]]
             ) -> list[RequestOutput]:
        engine = self.engine
        added: list[str] = []
        try:
            for request_id, text, ids, params, lora in requests:
                engine.add_request(request_id, ids, params, prompt=text, lora_name=lora)
                added.append(request_id)
            finished: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for request_id in added:
                engine.abort_request(request_id)
            engine.drain_aborted()
            raise
        return [finished[request_id] for request_id, *_ in requests]

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer().encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise RequestError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def _require_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise RequestError("this artifact has no tokenizer; pass prompts as lists of token ids")
        return self.engine.tokenizer


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """str -> [str]; [int, ...] -> one token prompt; [str | [int] | dict, ...] -> many."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if _is_token_ids(prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        for p in prompts:
            if not (isinstance(p, (str, dict)) or _is_token_ids(p)):
                raise RequestError(f"a prompt must be a string, a non-empty list of token ids or a dict; got {p!r:.80}")
        return list(prompts)
    raise RequestError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
