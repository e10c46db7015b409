"""Fixtures: offline tokenizers for each tool-calling family (a small byte-level BPE with the family's special
tokens and its public chat template from templates/), and the embedded model compiled to an artifact."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates"

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the weather in Paris today?",
    'Call the function with {"city": "Paris", "unit": "celsius"} and {"query": "weather", "limit": 3}.',
    '{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "days": [1, 2, 3]}}',
    '[{"name": "search", "parameters": {"q": "kiln", "page": 2, "exact": true, "score": 0.5e-3}}]',
    "I will look that up for you. Let me think about the question step by step.",
    "Sure! The temperature is 21 degrees, sunny with a light breeze from the west.",
    "```json\n{\"a\": 1}\n```  function tool call result content system user assistant",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:-_'\"()[]{}<>/\\|@#$%^&*+=~`",
]


@dataclass
class Family:
    name: str  # the template file's stem
    parser: str  # the tool parser the template implies
    bos: str | None
    eos: str
    special: tuple[str, ...]  # special tokens (HF `special: true`)
    added: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>, <think>)


FAMILIES = {
    "llama3_1": Family("llama3_1", "llama3_json", "<|begin_of_text|>", "<|eot_id|>",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")),
    "qwen2_5": Family("qwen2_5", "hermes", None, "<|im_end|>", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                      ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")),
    "qwen3_thinking_2507": Family("qwen3_thinking_2507", "hermes", None, "<|im_end|>",
                                  ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                                  ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                                   "</think>")),
    "mistral_v0_3": Family("mistral_v0_3", "mistral", "<s>", "</s>",
                           ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")),
    "deepseek_v3": Family("deepseek_v3", "deepseek_v3", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                          ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
                          ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<think>", "</think>")),
}


@dataclass
class FamilyTokenizer:
    family: Family
    template: str
    kiln: object  # kiln.runtime.tokenizer.Tokenizer
    hf: object  # transformers.PreTrainedTokenizerFast over the same tokenizers.Tokenizer


def build_family_tokenizer(family: Family) -> FamilyTokenizer:
    from kiln.runtime.tokenizer import Tokenizer as KilnTokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(family.special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    template = (TEMPLATES / f"{family.name}.jinja").read_text()
    config = {"bos_token": family.bos, "eos_token": family.eos, "chat_template": template}
    kiln = KilnTokenizer(tok, config)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos,
                                 chat_template=template)
    return FamilyTokenizer(family, template, kiln, hf)


@pytest.fixture(scope="session")
def family_tokenizer():
    """`family_tokenizer(name) -> FamilyTokenizer`, built once per session per family."""
    pytest.importorskip("transformers")
    cache: dict[str, FamilyTokenizer] = {}

    def get(name: str) -> FamilyTokenizer:
        if name not in cache:
            cache[name] = build_family_tokenizer(FAMILIES[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def embedded_artifact(tmp_path_factory) -> pathlib.Path:
    """examples/embedded (a trained 5.5 M-parameter Llama, 4096-token vocabulary) compiled for cpu."""
    import kiln

    recipe = REPO / "examples" / "embedded.dsl"
    if not (REPO / "examples" / "embedded" / "model.safetensors").exists():
        pytest.skip("the embedded checkpoint is not in this checkout")
    out = tmp_path_factory.mktemp("structured-embedded") / "art"
    kiln.compile(str(recipe), out, progress=False)
    return out
