"""lm-evaluation-harness against `kiln serve`: `--model local-completions` (echo + prompt logprobs over HTTP,
batched) gives the accuracy and per-item log-likelihoods of `--model hf` on the same checkpoint (fp32, within
1e-4), on a small multiple-choice task written here (JSONL + task YAML, nothing downloaded)."""
from __future__ import annotations

import json
import random

from live_server import LiveServer

NAME = "kiln_tiny_mc"
WORDS = ("kiln", "model", "block", "cache", "token", "prefix", "batch", "kernel", "graph", "queue", "fox", "dog")


def write_task(root) -> None:
    """Twelve questions of four choices each (one- to four-token continuations of different lengths)."""
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for i in range(12):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(4)]
            f.write(json.dumps({"question": question, "choices": choices, "label": i % 4}) + "\n")
    (root / f"{NAME}.yaml").write_text(f"""\
task: {NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "data.jsonl"}
  cache_dir: {root / "hf-datasets"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def evaluate(root, model, model_args: dict | None = None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[NAME], batch_size=4,
                                  task_manager=TaskManager(include_path=str(root), include_defaults=False),
                                  log_samples=True,
                                  bootstrap_iters=0, random_seed=0)
    lls = {(s["doc_id"], k): r[0] for s in out["samples"][NAME] for k, r in enumerate(s["filtered_resps"])}
    return {"acc": out["results"][NAME]["acc,none"], "ll": lls}


def test_local_completions_equals_hf(compile_hf, tmp_path, monkeypatch):
    """Twice: with the checkpoint's tokenizer and a BOS ("<s>" + context + continuation: lm-eval's hf model adds
    the tokenizer's BOS by default and its API models do not, `add_bos_token` makes the two requests the same);
    and with no local tokenizer at all: lm-eval finds the server's /tokenizer_info and /tokenize and tokenizes
    through them (no BOS, against hf without one)."""
    from lm_eval.api.registry import get_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    ckpt, art, _ = compile_hf("llama")
    write_task(tmp_path)
    server = LiveServer(art, {"num_kv_blocks": 256}, served_model_name="tiny-llama")
    api = {"model": "tiny-llama", "base_url": server.url + "/v1/completions", "tokenized_requests": True,
           "max_retries": 1, "num_concurrent": 1}
    try:
        with_bos = evaluate(tmp_path, "local-completions", {**api, "tokenizer_backend": "huggingface",
                                                            "tokenizer": str(ckpt), "add_bos_token": True})
        remote_lm = get_model("local-completions")(**api, batch_size=4)  # tokenizer_backend "auto"
        assert remote_lm.tokenizer_backend == "remote"
        remote = evaluate(tmp_path, remote_lm)
        server.wait_idle()
    finally:
        server.stop()
    hf = {"pretrained": str(ckpt), "dtype": "float32", "device": "cpu"}
    for served, reference in ((with_bos, evaluate(tmp_path, "hf", {**hf, "add_bos_token": True})),
                              (remote, evaluate(tmp_path, "hf", {**hf, "add_bos_token": False}))):
        assert len(served["ll"]) == len(reference["ll"]) == 48
        worst = max(abs(served["ll"][k] - reference["ll"][k]) for k in reference["ll"])
        assert worst < 1e-4, f"log-likelihoods differ from HF by up to {worst}"
        assert served["acc"] == reference["acc"]
    assert with_bos["ll"] != remote["ll"]  # the BOS does change them: the two pairs test different requests
