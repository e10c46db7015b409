"""Build tiny, randomly initialised Hugging Face checkpoints offline, for kiln's parity tests.

    python examples/make_tiny_checkpoint.py OUT_DIR [--arch llama] [--shards N]

Each checkpoint is a real `save_pretrained` directory (config.json, safetensors weights, generation_config.json,
tokenizer.json, tokenizer_config.json with a ChatML chat template) that transformers loads without the hub.
Weights are random but not degenerate: norm weights, biases and q/k norms are non-trivial, so a compiler that
drops one of them produces different logits.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import tempfile

import torch

# Special tokens sit at fixed ids; config.json and generation_config.json refer to them by id.
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(5)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's chat format (its checkpoints' template, written out here): turns between <start_of_turn> and
# <end_of_turn>, the assistant named "model", a system message folded into the first user turn, BOS from the
# template itself (chat prompts are encoded without special tokens, as transformers' apply_chat_template does).
GEMMA_SPECIAL_TOKENS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    # Larger than HF's 0.02 so logits are spread out and greedy decoding has no near-ties.
    "initializer_range": 0.1,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": False,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# Phi-4-mini's rope in miniature: 3/4 of each 16-dim head rotates (6 frequencies), LongRoPE over an original
# context of 32 of 128 (attention factor sqrt(1 + ln 4 / ln 32)); short and long factors both away from 1
PHI4_MINI = {
    "partial_rotary_factor": 0.75, "max_position_embeddings": 128, "original_max_position_embeddings": 32,
    "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                     "long_factor": [1.2, 1.9, 3.1, 5.0, 8.0, 12.5]},
}

# 3 layers: layer 0 dense (width 64), layers 1-2 mixture-of-experts: 4 routed experts of width 32 in 2 groups,
# top-2 from the best group, plus 1 shared expert; routed weights scaled (2.5 V3, 1.5 V2)
DEEPSEEK_MLA = {
    "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
}

# arch -> (config class name, overrides on top of TINY)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope": ("LlamaConfig", {"max_position_embeddings": 256, "rope_scaling": LLAMA3_ROPE}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_head_dim": ("LlamaConfig", {"head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": 16, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": False}),
    # MLA: q LoRA 24, latent 32, rope 8, nope 16, v 16; MLA expands K/V to every head (kv heads = heads).
    # V3 routes by sigmoid + correction bias (top-2-sum group scores, renormalised); V2 by softmax,
    # group_limited_greedy (max group scores), not renormalised
    "deepseek_v3": ("DeepseekV3Config", {**DEEPSEEK_MLA, "q_lora_rank": 24, "routed_scaling_factor": 2.5,
                                         "norm_topk_prob": True}),
    "deepseek_v2": ("DeepseekV2Config", {**DEEPSEEK_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                                         "routed_scaling_factor": 1.5}),
    # 4 experts, top-2; expert width 32 (Qwen3-MoE: moe_intermediate_size; its dense width is unused)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "phi3": ("Phi3Config", {"sliding_window": None}),  # fused qkv_proj / gate_up_proj in the checkpoint
    "phi4_mini": ("Phi3Config", {"sliding_window": None, **PHI4_MINI}),
    # Llama with its four scalars away from 1 (IBM's 3.x checkpoints: 12, 0.22, 0.0078125, 8); tied embeddings
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.2, "logits_scaling": 4.0, "tie_word_embeddings": True}),
    # 4 layers, window 8: layers 0, 1, 3 slide (rope base 10k), layer 2 is global (base 1M, linear x8 as the 4B+);
    # query_pre_attn_scalar 24 != head_dim 16; q/k norms; sandwich norms; GELU-tanh; tied embeddings
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        "tie_word_embeddings": True}),
    # alternating sliding (window 8) and global layers; attention scores soft-capped at 50, final logits at 30
    "gemma2": ("Gemma2Config", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "use_sliding_window": False, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}),
    # 4 layers alternating sliding (window 8) and full; attention sinks (random, std 1); YaRN x8 over an original
    # context of 64 (truncate false, as OpenAI's); 4 biased experts top-2 of width 32 (gate/up interleaved, stored
    # [E, in, out]); swiglu_limit 1 so some of the tiny model's gates and ups reach the clamps
    "gpt_oss": ("GptOssConfig", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 32, "swiglu_limit": 1.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0}}),
}

CORPUS = """\
The kiln was built at the edge of the village, where the clay from the river bank was soft and grey.
Every morning the potter walked down to the water and carried back two heavy buckets of wet clay.
She kneaded the clay on a wooden table until it was smooth, and then she shaped it on the wheel.
Bowls, cups, plates and tall jars stood in rows on the shelves, drying slowly in the shade.
When the shelves were full, it was time to fire the kiln, and the whole family came to help.
They stacked the pots carefully inside, leaving small gaps so that the hot air could move between them.
The fire was started at dawn with dry sticks, and by noon the kiln was glowing a deep orange.
Her son counted the hours and added wood whenever the flames grew weak.
By evening the colour inside had turned from orange to a bright, almost white yellow.
Then they closed the door with bricks and mud and let the kiln cool for two days.
Opening the kiln is always the most exciting moment, because no one knows exactly what will come out.
Some pots crack, some glazes run, and a few pieces turn out more beautiful than anyone expected.
A good potter learns from every firing and writes down the weather, the wood and the temperature.
Over many years those notes become a map of the kiln, showing its hot corners and its cool ones.
The market in the town was held every Saturday, and the potter sold her work from a small cart.
People asked about the blue glaze, which she made from crushed stones and ash from the fire.
A child once asked her why the cups were not all the same, and she laughed and said that hands are not machines.
In the spring the river rose and the clay pits filled with water, so the work had to wait.
In the summer the days were long, and the pots dried quickly in the warm wind.
In the autumn the wood was cut and stacked, ready for the cold months ahead.
In the winter the kiln kept the workshop warm, and friends came in to sit near the fire and talk.
A computer reads text as a sequence of tokens, and each token is a small piece of a word.
The tokenizer learns which pieces appear often, and it merges frequent pairs of bytes into new tokens.
A language model predicts the next token from all of the tokens that came before it.
During prefill the model reads the whole prompt at once, and during decode it writes one token at a time.
The attention layer compares each new query with the keys of every earlier position in the sequence.
Keys and values are stored in a cache, so that they do not have to be computed again for the next token.
The cache is split into fixed-size blocks, and a block table says where each sequence keeps its blocks.
When many users send requests at the same time, the server batches them together to keep the hardware busy.
A scheduler decides which requests run in each step, and it makes sure the memory never runs out.
Short questions get quick answers, while long documents are read in several chunks.
The compiler turns a description of the model into plain code that anyone can open and read.
Each pass of the compiler does one small job, such as fusing two operations into one kernel.
Tests compare the output of the compiled model with a reference, token by token and number by number.
If the numbers differ, the engineer looks for a missing bias, a wrong scale, or a norm in the wrong place.
Rotary position embeddings rotate pairs of numbers by an angle that grows with the position.
A sliding window lets each token see only the most recent part of the text, which saves memory.
Grouped query attention shares one key head among several query heads.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Can you tell me a story about a cat who lived in a lighthouse by the sea?
Once upon a time, a grey cat named Pebble lived at the top of a tall white lighthouse.
Every night Pebble watched the great lamp turn, sending its beam across the dark water.
The sailors knew the light, and some of them said they could see a small shadow in the window.
One stormy night the lamp went out, and the keeper could not find the matches in the dark.
Pebble knew every corner of the tower, and she led him down the stairs to the old wooden box.
The lamp was lit again just in time, and a fishing boat turned away from the rocks.
After that night the keeper always kept a dish of fish by the window for his clever friend.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four.
Please write a short poem about the rain.
The rain falls soft on the roof at night, it taps the glass and dims the light.
Thank you for your help. You are welcome, and have a nice day.
The quick brown fox jumps over the lazy dog.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
A journey of a thousand miles begins with a single step.
The early bird catches the worm, but the second mouse gets the cheese.
Water boils at one hundred degrees Celsius at sea level.
The sun rises in the east and sets in the west.
There are seven days in a week and twelve months in a year.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
def add(a, b): return a + b
for i in range(10): print(i * i)
{"name": "kiln", "version": "0.1.0", "tokens": [1, 2, 3]}
"""

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def corpus_lines() -> list[str]:
    """A few hundred lines of plain English (and a little code and JSON) to train the tokenizer on."""
    lines = CORPUS.splitlines()
    for i, word in enumerate(NUMBER_WORDS):
        lines.append(f"Line {i}: the number {word} is written as {i}, and {i} times {i} is {i * i}.")
        lines.append(f"There were {word} pots on the shelf and {word} cups on the table.")
    for a in range(3):
        for sentence in CORPUS.splitlines():
            words = sentence.split()
            lines.append(" ".join(words[a::3]))  # shuffled variants enlarge the sample without new text
    return lines


def build_tokenizer(vocab_size: int, gemma: bool = False):
    """Train a byte-level BPE (GPT-2 / Llama-3 style) on CORPUS; specials at ids 0..4, <s> prepended.
    `gemma`: Gemma's special tokens (<bos>, <eos>, <pad>, <start_of_turn>, <end_of_turn>) and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = GEMMA_SPECIAL_TOKENS if gemma else SPECIAL_TOKENS
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    bos, eos, pad, *turns = specials
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    assert [tokenizer.token_to_id(t) for t in specials] == list(range(len(specials)))
    assert tokenizer.get_vocab_size() <= vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        additional_special_tokens=turns,
        chat_template=GEMMA_CHAT_TEMPLATE if gemma else CHAT_TEMPLATE,
    )


def make_config(arch: str, **overrides):
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    class_name, arch_overrides = ARCHS[arch]
    kwargs = {**TINY, **arch_overrides, **overrides}
    return getattr(transformers, class_name)(attn_implementation="eager", **kwargs)


@torch.no_grad()
def _randomize_non_matmul_weights(model: torch.nn.Module, std: float) -> None:
    """HF initialises norms to 1 and biases to 0; make them non-trivial so a dropped one shows in the logits."""
    # Gemma's norms scale by 1 + w (HF initialises w to 0): random around 0 there, the same effective scale
    norm_base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # input/post-attention/final norms, Qwen3 q_norm/k_norm
            param.copy_(norm_base + 0.5 * torch.randn_like(param))
        elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
            param.normal_(0.0, std)
        elif name.endswith(".sinks"):  # gpt-oss's per-head sink logits: large enough to take real mass
            param.normal_(0.0, 1.0)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias steers expert choice
            buf.normal_(0.0, std)


def _save_sharded(model, out_dir: pathlib.Path, num_shards: int) -> None:
    """save_pretrained with a max_shard_size that yields exactly `num_shards` files (greedy sharding may overshoot)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    shard_size = math.ceil(total / num_shards)
    while True:
        with tempfile.TemporaryDirectory() as probe:
            model.save_pretrained(probe, max_shard_size=shard_size)
            produced = len(list(pathlib.Path(probe).glob("*.safetensors")))
        if produced <= num_shards:
            break
        shard_size = math.ceil(shard_size * 1.05)
    model.save_pretrained(out_dir, max_shard_size=shard_size)


def build_tiny_checkpoint(
    out_dir: str | pathlib.Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
    legacy_config: bool = False,
    extra_tokens: tuple[str, ...] = (),
    **config_overrides,
) -> pathlib.Path:
    """Write a tiny random `arch` checkpoint into `out_dir` and return its path.

    archs: llama (GQA 4:2), llama3_rope (Llama-3.1 rope scaling, original context 64 of 256), llama_tied,
    llama_head_dim (head_dim 32 != 64/4), mistral (sliding window 16), qwen2 (q/k/v bias), qwen3 (q/k norm),
    mixtral and qwen3_moe (4 experts, top-2; stored one tensor per expert), deepseek_v3 and deepseek_v2 (MLA;
    3 layers, the first dense, then 4 routed experts top-2 in 2 groups + 1 shared expert), gemma3 (4 layers,
    window 8, layer 2 global with linear rope x8; Gemma tokens and chat template), gemma2 (alternating
    layers, soft-capped attention and logits), gpt_oss (4 layers alternating sliding window 8 and full, attention
    sinks, YaRN, 4 biased experts top-2 under the clamped SwiGLU), granite (Llama with embedding, residual and attention
    multipliers and a logits divisor) and phi4_mini (Phi-3 with partial rotary 0.75 and LongRoPE, original
    context 32 of 128).
    `config_overrides` go to the transformers config (e.g. num_hidden_layers=1).
    `extra_tokens`: words added to the tokenizer as whole (non-special) tokens, at the top ids of the vocabulary
    (the BPE trains on the rest), e.g. ("yes", "no") for a Qwen3-Reranker-style yes/no scorer.
    transformers 5 writes rope settings as `rope_parameters` (rope_theta inside); `legacy_config=True`
    rewrites config.json the way most hub checkpoints still read: top-level `rope_theta` + `rope_scaling`.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(arch, **config_overrides)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_non_matmul_weights(model, config.initializer_range)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID, do_sample=False
    )
    if num_shards > 1:
        _save_sharded(model, out, num_shards)
    else:
        model.save_pretrained(out)

    tokenizer = build_tokenizer(config.vocab_size - len(extra_tokens), gemma=arch.startswith("gemma"))
    if extra_tokens:
        assert tokenizer.add_tokens(list(extra_tokens)) == len(extra_tokens)
        assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in extra_tokens)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (the classic layout)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _edit_json(out / "tokenizer_config.json", _portable_tokenizer_config)
    if legacy_config:
        _edit_json(out / "config.json", _legacy_rope_keys)
    _check_special_ids(out)
    return out


def _edit_json(path: pathlib.Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")


def _portable_tokenizer_config(config: dict) -> dict:
    # transformers 5 writes its own "TokenizersBackend"; the classic class name loads in 4.x and 5.x alike
    return {**config, "tokenizer_class": "PreTrainedTokenizerFast"}


def _legacy_rope_keys(config: dict) -> dict:
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    return config


def _check_special_ids(out: pathlib.Path) -> None:
    config = json.loads((out / "config.json").read_text())
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos = ("<bos>", "<eos>") if "<bos>" in vocab else ("<s>", "</s>")
    assert vocab[bos] == config["bos_token_id"] and vocab[eos] == config["eos_token_id"], (
        f"tokenizer specials {vocab[bos]}/{vocab[eos]} disagree with config.json"
    )


def load_hf_model(path: str | pathlib.Path):
    """The checkpoint as a transformers model: fp32, eager attention, eval mode — the parity reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--legacy-config", action="store_true", help="rope_theta + rope_scaling keys")
    args = parser.parse_args(argv)
    path = build_tiny_checkpoint(
        args.out_dir,
        args.arch,
        seed=args.seed,
        num_shards=args.shards,
        dtype=getattr(torch, args.dtype),
        legacy_config=args.legacy_config,
    )
    print(path)


if __name__ == "__main__":
    main()
