"""Errors codegen reports to a user: a kernel it cannot emit, a checkpoint that does not fit the model."""
from __future__ import annotations

from collections.abc import Iterable

from kiln.dsl.errors import KilnError, SourceError


class CodegenError(SourceError):
    """The program cannot be turned into an artifact (no emitter for a kernel, an untyped value, ...).

    `loc` is the DSL position of the offending node when known.
    """


class WeightError(SourceError):
    """A checkpoint tensor is missing or has the wrong shape; `loc` is the DSL `param` declaration."""


class CheckpointError(KilnError):
    """The checkpoint directory cannot be read (missing, no safetensors files, a broken index)."""


class TokenizerError(KilnError):
    """A tokenizer file the artifact would carry does not load (checked at compile time, not at serve time)."""


def fmt_shape(shape: Iterable[int | str]) -> str:
    """A shape as error messages write it: `[64, 32]`."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


__all__ = ["CheckpointError", "CodegenError", "KilnError", "TokenizerError", "WeightError", "fmt_shape"]
