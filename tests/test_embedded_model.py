"""The committed embedded default model (examples/embedded/, built by scripts/train_embedded.py) is a real,
offline-loadable HF Llama checkpoint that has actually learned English (not a random init)."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO = pathlib.Path(__file__).resolve().parent.parent
CKPT = REPO / "examples" / "embedded"
RECIPE = REPO / "examples" / "embedded.dsl"
MAX_BYTES = 25 * 1024 * 1024

# Documents from the 2% validation split (never trained on), plus two sentences written for this test.
HELD_OUT = [
    "Life is a whim of several billion cells to be you for a while.",
    "The meek shall inherit the earth; the rest of us, the Universe.",
    "Experience is what causes a person to make new mistakes instead of old ones.",
    "How long a minute is depends on which side of the bathroom door you're on.",
    "I came to MIT to get an education for myself and a diploma for my mother.",
    "All a man needs out of life is a place to sit 'n' spit in the fire.",
    "Oh, give me a home,\nWhere the buffalo roam,\nAnd I'll show you a house with a really messy kitchen.",
    "The Martian Canals were clearly the Martian's last ditch effort!",
    "A good friend is someone who tells you the truth, even when you do not want to hear it.",
    "The best way to learn a new language is to speak it every day with people who know it well.",
]


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(CKPT, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # tiny matmuls: one thread is fastest, and polite on shared CPUs
    m = transformers.LlamaForCausalLM.from_pretrained(CKPT, attn_implementation="eager", local_files_only=True,
                                                      dtype=torch.float32)
    yield m.eval()
    torch.set_num_threads(threads)


def test_files_and_size():
    names = {p.name for p in CKPT.iterdir()}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "LICENSE-DATA"):
        assert f in names, f
    total = sum(p.stat().st_size for p in CKPT.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, f"{total / 2**20:.1f} MiB committed"


def test_config_is_llama(tok):
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]          # GQA
    assert cfg["vocab_size"] == len(tok)
    gen = json.loads((CKPT / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert tok.convert_tokens_to_ids("</s>") in eos and tok.convert_tokens_to_ids("<|im_end|>") in eos


def test_recipe_matches_config():
    cfg = json.loads((CKPT / "config.json").read_text())
    text = RECIPE.read_text()
    assert 'hf:./embedded' in text
    for key, val in [("vocab", cfg["vocab_size"]), ("hidden", cfg["hidden_size"]),
                     ("layers", cfg["num_hidden_layers"]), ("heads", cfg["num_attention_heads"]),
                     ("kv_heads", cfg["num_key_value_heads"]), ("ffn", cfg["intermediate_size"])]:
        assert f"{key}={val}" in text.replace(" ", ""), key


def test_tokenizer_round_trip_and_chat_template(tok):
    text = "Hello, world!  The quick brown fox -- jumps over\n\tthe lazy dog. 3.14159 ~ `code` \u00e9t\u00e9"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert chat_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def _mean_losses(model, seqs: list[list[int]]) -> list[float]:
    """Per-token loss of each sequence, summed over the sequence; one right-padded causal batch."""
    width = max(map(len, seqs))
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=mask).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
    return (nll * mask[:, 1:]).sum(1).tolist()


def test_learned_english(model, tok):
    """Held-out English scores far below uniform; the same tokens shuffled score much worse."""
    gen = torch.Generator().manual_seed(0)
    eos = tok.eos_token_id
    english, shuffled = [], []
    for text in HELD_OUT:
        ids = tok(text)["input_ids"] + [eos]               # <s> text </s>
        body = ids[1:-1]
        english.append(ids)
        shuffled.append([ids[0], *[body[i] for i in torch.randperm(len(body), generator=gen).tolist()], eos])
    n = sum(len(s) - 1 for s in english)
    eng = sum(_mean_losses(model, english)) / n
    shuf = sum(_mean_losses(model, shuffled)) / n
    uniform = math.log(model.config.vocab_size)
    assert eng < 0.6 * uniform, (eng, uniform)
    assert shuf > eng + 1.5, (eng, shuf)


def test_greedy_generation_is_words(model, tok):
    ids = tok("The meaning of life is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = [w.strip(".,;:!?\"'()-") for w in text.split()]
    words = [w for w in words if w]
    assert words, text
    alpha = sum(w.isalpha() for w in words) / len(words)
    assert alpha > 0.6, text
