"""An embedding artifact's pooling, read from the checkpoint's sentence-transformers config (`task = embed`).

`modules.json` lists the modules; its `sentence_transformers.models.Pooling` entry's directory (usually
`1_Pooling`) holds `config.json` with `pooling_mode_lasttoken` / `pooling_mode_mean_tokens` (one of them set),
and a `sentence_transformers.models.Normalize` entry L2-normalizes. Without `modules.json` the pooling is
Qwen3-Embedding's and e5-mistral's: the last token, normalized. Matryoshka: `matryoshka_dimensions` (a list) or
`is_matryoshka: true` (any size up to hidden) in the model's config.json, as vLLM reads them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CodegenError

POOLING_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
UNSUPPORTED = ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CodegenError(f"cannot read {path}: {e}", None) from None


def embedding_section(ckpt: Path | None, hidden: int, hf_config: dict) -> dict[str, Any]:
    """The manifest's `embedding` section: {pooling: last|mean, normalize, hidden, matryoshka: dims or None}."""
    pooling, normalize = "last", True
    modules_file = ckpt / "modules.json" if ckpt is not None else None
    if modules_file is not None and modules_file.is_file():
        modules = _json(modules_file)
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith(".Normalize") for t in types)
        pool = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        if pool is not None:
            cfg = _json(ckpt / pool.get("path", "1_Pooling") / "config.json")
            modes = [v for k, v in POOLING_KEYS.items() if cfg.get(k)]
            other = [k for k in UNSUPPORTED if cfg.get(k)]
            if other or len(modes) != 1:
                raise CodegenError(f"{ckpt / pool.get('path', '1_Pooling') / 'config.json'}: kiln pools by the "
                                   f"last token or the mean of the tokens (one of them), not {other or modes}", None)
            pooling = modes[0]
        if any(t.endswith(".Dense") for t in types):
            raise CodegenError(f"{modules_file}: a Dense module after pooling is not supported", None)
    dims = hf_config.get("matryoshka_dimensions")
    matryoshka = sorted(int(d) for d in dims) if isinstance(dims, list) else (
        [] if hf_config.get("is_matryoshka") else None)  # []: any size up to hidden
    return {"pooling": pooling, "normalize": normalize, "hidden": int(hidden), "matryoshka": matryoshka}
