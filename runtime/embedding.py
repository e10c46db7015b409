"""Embedding results as the front-ends return them (the LLM API, /v1/embeddings): pure Python, no torch.

The core returns each request's pooled vector, normalized where the artifact's manifest `embedding` section
says (core/pooling.py); `dimensions` (Matryoshka models only) keeps the first d values and normalizes again.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import RequestError


def embedding_section(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The manifest's `embedding` section, None for a generation artifact."""
    return dict(manifest["embedding"]) if manifest.get("task") == "embed" else None


def check_dimensions(section: Mapping[str, Any], dimensions: int | None) -> None:
    """RequestError (a 400) unless `dimensions` is None or a size this Matryoshka model was trained for."""
    if dimensions is None:
        return
    dims, hidden = section.get("matryoshka"), int(section["hidden"])
    if dims is None:
        raise RequestError("this model does not support 'dimensions' (it is not a Matryoshka model)")
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden or (
            dims and dimensions not in dims):
        allowed = ", ".join(map(str, dims)) if dims else f"1 to {hidden}"
        raise RequestError(f"dimensions must be one of {allowed}, got {dimensions!r}")


def shape(vector: list[float], section: Mapping[str, Any], dimensions: int | None) -> list[float]:
    """`vector` cut to `dimensions` (checked) and normalized again when the model normalizes."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    cut = vector[:dimensions]
    if not section.get("normalize"):
        return cut
    norm = math.sqrt(sum(v * v for v in cut)) or 1.0
    return [v / norm for v in cut]
