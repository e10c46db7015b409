#!/usr/bin/env python3
"""Build kiln's embedded default model (examples/embedded/) from scratch, reproducibly.

    python scripts/train_embedded.py --prepare-data          # apt-get download + unpack + clean (Debian fortunes)
    python scripts/train_embedded.py --train --minutes 40    # tokenizer + Llama model, writes examples/embedded/
    python scripts/train_embedded.py --prepare-data --train --minutes 40

Data: Debian's `fortunes`, `fortunes-min` and `fortunes-debian-hints` packages (BSD licence, see
examples/embedded/LICENSE-DATA and docs/embedded_model.md). The offensive collection (`fortunes-off`) is
never downloaded. Only the English top-level cookie files are used; `ascii-art` (pictures, not prose) and
`ethnic` (ethnic jokes; unsuitable for a default model) are skipped.

The raw corpus is not committed: `--prepare-data` fetches it with `apt-get download` (needs a Debian/Ubuntu
apt source; no root needed for `download`) into --data-dir and writes train.txt / val.txt there (documents
separated by a line holding only \\x1e).

Everything is seeded (--seed). The training length is a wall-clock budget (--minutes) unless --steps is
given; the learning-rate schedule follows the fraction of the budget used, so a run with --steps N is
bit-for-bit reproducible on the same machine and a --minutes run is reproducible up to where it stops.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "examples" / "embedded"
DEFAULT_DATA_DIR = Path(os.environ.get("KILN_EMBEDDED_DATA", "/tmp/kiln-embedded-data"))

PACKAGES = ["fortunes", "fortunes-min", "fortunes-debian-hints"]
SKIP_FILES = {"ascii-art", "ethnic"}          # pictures; ethnic jokes
DOC_SEP = "\x1e"

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# User turns used to teach the model the ChatML layout (the answer is always a fortune).
CHAT_PROMPTS = ["Tell me a fortune.", "Say something wise.", "Give me a quote.", "Tell me a joke.",
                "What do you think?", "Any advice?", "Hello!", "Cheer me up.", "Say something funny.",
                "What is the meaning of life?"]
CHAT_FRACTION = 0.15

# Architecture (HF LlamaConfig names). ~5.5M parameters; tied embeddings.
ARCH = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=704, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


# ----------------------------------------------------------------------------------------------- data
def _run(cmd, cwd=None):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def clean_fortune(text: str) -> str | None:
    lines = [ln.rstrip() for ln in text.replace("\r", "").split("\n")]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return None
    text = "\n".join(lines).expandtabs(8)
    text = re.sub(r"[^\S\n]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    # Drop pictures and non-prose: too few letters, or very long (multi-page) entries.
    letters = sum(c.isalpha() for c in text)
    if letters < 0.5 * len(text.replace(" ", "").replace("\n", "")) or letters < 8:
        return None
    if len(text) > 4000:
        return None
    try:
        text.encode("ascii")
    except UnicodeEncodeError:
        non_ascii = sum(ord(c) > 127 for c in text)
        if non_ascii > 0.05 * len(text):     # mostly non-English
            return None
    return text


def read_fortune_file(path: str) -> list[str]:
    raw = Path(path).read_bytes().decode("utf-8", errors="replace")
    out = []
    for part in re.split(r"^%\s*$", raw, flags=re.M):
        t = clean_fortune(part)
        if t:
            out.append(t)
    return out


def prepare_data(data_dir: Path, seed: int, val_fraction: float = 0.02) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    debs = data_dir / "debs"
    root = data_dir / "root"
    if debs.exists():
        shutil.rmtree(debs)
    if root.exists():
        shutil.rmtree(root)
    debs.mkdir()
    _run(["apt-get", "download", *PACKAGES], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root)])
    # Record exactly what was used.
    manifest = {"packages": sorted(p.name for p in debs.glob("*.deb")),
                "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(debs.glob("*.deb"))}}
    cookie_dir = root / "usr/share/games/fortunes"
    files = sorted(p for p in cookie_dir.iterdir()
                   if p.is_file() and not p.is_symlink() and "." not in p.name and p.name not in SKIP_FILES)
    assert not any("off" == p.parent.name for p in files), "offensive fortunes must not be used"
    docs, seen, per_file = [], set(), {}
    for f in files:
        n = 0
        for t in read_fortune_file(str(f)):
            key = re.sub(r"\s+", " ", t).strip().lower()
            if key in seen:
                continue
            seen.add(key)
            docs.append(t)
            n += 1
        per_file[f.name] = n
    manifest["files"] = per_file
    manifest["documents"] = len(docs)
    rng = random.Random(seed)
    rng.shuffle(docs)
    n_val = max(1, int(round(val_fraction * len(docs))))
    val, train = docs[:n_val], docs[n_val:]
    (data_dir / "train.txt").write_text(f"\n{DOC_SEP}\n".join(train) + "\n", encoding="utf-8")
    (data_dir / "val.txt").write_text(f"\n{DOC_SEP}\n".join(val) + "\n", encoding="utf-8")
    manifest["train_docs"], manifest["val_docs"] = len(train), len(val)
    manifest["train_chars"], manifest["val_chars"] = sum(map(len, train)), sum(map(len, val))
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=1))


def load_docs(path: Path) -> list[str]:
    return [d.strip("\n") for d in path.read_text(encoding="utf-8").split(f"\n{DOC_SEP}\n") if d.strip()]


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(train_docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def save_tokenizer_files(tok, out: Path) -> dict:
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": ARCH["max_position_embeddings"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]},
        indent=2) + "\n")
    return ids


def encode_docs(tok, docs: list[str], rng: random.Random, chat_fraction: float) -> list[int]:
    """One token stream: <s> text </s> per document; a fraction wrapped as a ChatML exchange instead."""
    ids_bos, ids_eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    stream: list[int] = []
    texts = []
    for d in docs:
        if rng.random() < chat_fraction:
            q = rng.choice(CHAT_PROMPTS)
            texts.append((True, f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{d}{IM_END}\n"))
        else:
            texts.append((False, d))
    encs = tok.encode_batch([t for _, t in texts], add_special_tokens=False)
    for (is_chat, _), e in zip(texts, encs):
        stream.append(ids_bos)
        stream.extend(e.ids)
        if not is_chat:
            stream.append(ids_eos)
    return stream


# ---------------------------------------------------------------------------------------------- train
def build_model(vocab_size: int, ids: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = dict(ARCH, vocab_size=vocab_size)
    cfg = LlamaConfig(**arch, hidden_act="silu", attention_bias=False, mlp_bias=False,
                      attention_dropout=0.0, initializer_range=0.02,
                      bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD])
    return LlamaForCausalLM(cfg)


def evaluate(model, data, seq_len: int, batch: int, max_batches: int | None = None) -> float:
    import torch

    model.eval()
    n = (len(data) - 1) // seq_len
    losses, count = 0.0, 0
    with torch.no_grad():
        for b0 in range(0, n, batch):
            if max_batches is not None and b0 // batch >= max_batches:
                break
            idx = torch.arange(b0, min(n, b0 + batch))
            x = torch.stack([data[i * seq_len:(i + 1) * seq_len] for i in idx.tolist()])
            y = torch.stack([data[i * seq_len + 1:(i + 1) * seq_len + 1] for i in idx.tolist()])
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                                     reduction="sum")
            losses += loss.item()
            count += y.numel()
    model.train()
    return losses / max(count, 1)


def save_checkpoint(model, tok_ids, out: Path, dtype: str, meta: dict) -> None:
    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / (out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    m = model
    if dtype == "bf16":
        import copy
        m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.use_cache = True
    m.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=tok_ids[BOS], eos_token_id=[tok_ids[EOS], tok_ids[IM_END]],
                     pad_token_id=tok_ids[PAD], do_sample=True, temperature=0.8, top_p=0.95,
                     max_new_tokens=128).save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(out / f, tmp / f)
    (tmp / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for p in tmp.iterdir():
        os.replace(p, out / p.name)
    tmp.rmdir()


def train(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    data_dir = Path(args.data_dir)
    train_docs, val_docs = load_docs(data_dir / "train.txt"), load_docs(data_dir / "val.txt")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    if args.init_from:
        # Continue from an earlier checkpoint of this script: same tokenizer, weights as the starting point
        # (fresh optimizer state and a fresh warmup + cosine schedule over this run's budget).
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json"))
        if Path(args.init_from).resolve() != out.resolve():
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(Path(args.init_from) / f, out / f)
        ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    else:
        tok = train_tokenizer(train_docs, args.vocab)
        ids = save_tokenizer_files(tok, out)
    vocab = tok.get_vocab_size()
    rng = random.Random(args.seed)
    train_ids = torch.tensor(encode_docs(tok, train_docs, rng, CHAT_FRACTION), dtype=torch.long)
    val_ids = torch.tensor(encode_docs(tok, val_docs, random.Random(args.seed + 1), 0.0), dtype=torch.long)
    print(f"tokenizer: vocab={vocab} in {time.time() - t0:.1f}s; train tokens={len(train_ids)} "
          f"val tokens={len(val_ids)} ({sum(map(len, train_docs)) / len(train_ids):.2f} chars/token)", flush=True)

    model = build_model(vocab, ids)
    prev = None
    if args.init_from:
        from transformers import LlamaForCausalLM
        init = LlamaForCausalLM.from_pretrained(args.init_from, local_files_only=True, dtype=torch.float32)
        model.load_state_dict(init.state_dict())
        prev = json.loads((Path(args.init_from) / "training_meta.json").read_text())
        print(f"initialised from {args.init_from} (step {prev.get('step', prev.get('steps'))})", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    budget = args.minutes * 60.0
    seq, bs = args.seq_len, args.batch
    gen = torch.Generator().manual_seed(args.seed)
    n_starts = len(train_ids) - seq - 1

    def lr_at(step: int, frac: float) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    t_start = time.time()
    last_ckpt = t_start
    step, tokens, ema = 0, 0, None
    history = []
    model.train()
    while True:
        elapsed = time.time() - t_start
        frac = (step / args.steps) if args.steps else (elapsed / budget)
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, frac)
        starts = torch.randint(0, n_starts, (bs,), generator=gen)
        x = torch.stack([train_ids[s:s + seq] for s in starts.tolist()])
        y = torch.stack([train_ids[s + 1:s + seq + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            el = time.time() - t_start
            print(f"step {step} loss {ema:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{tokens / el:.0f} tok/s {el / 60:.1f} min", flush=True)
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            vl = evaluate(model, val_ids, seq, 32, max_batches=4)
            history.append({"step": step, "minutes": round((time.time() - t_start) / 60, 1),
                            "train_loss_ema": round(ema, 4), "val_loss": round(vl, 4)})
            print(f"== checkpoint step {step}: train(ema) {ema:.3f} val {vl:.3f}", flush=True)
            save_checkpoint(model, ids, out, args.save_dtype,
                            {"partial": True, "step": step, "tokens": tokens, "history": history})
            last_ckpt = time.time()

    train_minutes = (time.time() - t_start) / 60
    val_loss = evaluate(model, val_ids, seq, 32)
    # Train loss measured the same way (no dropout, full sequences) on a fixed sample of the training stream.
    sample = train_ids[: min(len(train_ids), len(val_ids) * 2)]
    train_loss = evaluate(model, sample, seq, 32)
    meta = {"partial": False, "seed": args.seed, "steps": step, "tokens_seen": tokens,
            "train_minutes": round(train_minutes, 1), "threads": args.threads,
            "seq_len": seq, "batch": bs, "lr": args.lr, "autocast_bf16": args.autocast, "parameters": n_params,
            "train_tokens": len(train_ids), "val_tokens": len(val_ids),
            "final_train_loss": round(train_loss, 4), "final_val_loss": round(val_loss, 4),
            "uniform_loss": round(math.log(vocab), 4), "history": history,
            "save_dtype": args.save_dtype, "init_from": args.init_from, "init_meta": prev}
    print(json.dumps(meta, indent=1), flush=True)
    save_checkpoint(model, ids, out, args.save_dtype, meta)
    print(f"wrote {out}", flush=True)


SAMPLE_PROMPTS = ["The meaning of life is", "A computer is", "Never trust a man who"]


def samples(args) -> None:
    """Greedy and sampled continuations from the saved HF checkpoint (as quoted in docs/embedded_model.md)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=48, do_sample=False, repetition_penalty=1.0)
            torch.manual_seed(args.seed)
            sampled = model.generate(ids, max_new_tokens=48, do_sample=True, temperature=0.8, top_p=0.95)
        for kind, o in (("greedy", greedy), ("sampled", sampled)):
            print(f"--- {kind}: {prompt!r}\n{prompt}{tok.decode(o[0, ids.shape[1]:], skip_special_tokens=True)}")
    msgs = [{"role": "user", "content": "Tell me a fortune."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    torch.manual_seed(args.seed)
    with torch.no_grad():
        o = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95)
    print(f"--- chat (sampled): 'Tell me a fortune.'\n{tok.decode(o[0, ids.shape[1]:], skip_special_tokens=True)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare-data", action="store_true")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--samples", action="store_true", help="print greedy/sampled continuations from --out")
    ap.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=ARCH["vocab_size"])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads; use 1 on a machine whose cores are busy (OpenMP barriers stall when oversubscribed)")
    ap.add_argument("--init-from", default=None, help="start from this checkpoint dir (and its tokenizer)")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for the forward pass (fp32 master weights and optimizer state)")
    ap.add_argument("--save-dtype", choices=["fp32", "bf16"], default="bf16")
    args = ap.parse_args(argv)
    if not (args.prepare_data or args.train or args.samples):
        ap.error("nothing to do: pass --prepare-data, --train and/or --samples")
    if args.prepare_data:
        prepare_data(Path(args.data_dir), args.seed)
    if args.train:
        train(args)
    if args.samples:
        samples(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
