"""Random PEFT LoRA adapters over the tiny HF checkpoints (built offline) and artifacts compiled with them."""
from __future__ import annotations

import pathlib

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ATTENTION_MLP = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, out: pathlib.Path, *, targets, rank: int = 8, alpha: int = 16, seed: int = 0,
                 **config) -> pathlib.Path:
    """Saves a PEFT LoRA adapter with random (non-zero) A and B over `base_model` to `out`; returns it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                     lora_dropout=0.0, **config)
    peft_model = get_peft_model(base_model, cfg)
    with torch.no_grad():  # PEFT's non-default init is small; scale B up so the branch moves the logits
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    base_model = peft_model.unload()  # the base model back, without the adapter's layers
    return out


def peft_logits(base_dir: pathlib.Path, adapter_dir: pathlib.Path | None, tokens: list[int], load_hf_model):
    """HF transformers logits [len(tokens), vocab] of the base model with `adapter_dir` applied by PeftModel."""
    from peft import PeftModel

    model = load_hf_model(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def peft_greedy(base_dir: pathlib.Path, adapter_dir: pathlib.Path, prompt: list[int], n: int,
                load_hf_model) -> list[int]:
    """HF peft's greedy continuation (an argmax loop over full sequences) of `prompt`, `n` tokens."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf_model(base_dir), str(adapter_dir)).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def lora_recipe(recipe: str, lora_section: str) -> str:
    """The `kiln recipe from-hf` recipe with a `lora { ... }` section added."""
    body, last = recipe.rsplit("}", 1)
    return f"{body}  lora {{ {lora_section} }}\n}}{last}"
