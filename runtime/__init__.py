"""kiln.runtime: loads a compiled artifact and serves it; one folder per process (api/, core/, worker/, ipc/, disagg/; docs/runtime.md, "Layout")."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import threads
from .errors import ArtifactError, KilnRuntimeError, RequestError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

# Heavier pieces load on first use, so `import kiln` stays cheap for the CLI and the compiler, and an API
# server process (which never runs the model) does not import torch.
_LAZY = {
    "LLM": ".llm", "LLMEngine": ".llm_engine", "EngineCore": ".core.engine", "load_artifact": ".artifact",
    "LoadedArtifact": ".artifact", "Tokenizer": ".tokenizer", "IncrementalDetokenizer": ".tokenizer",
    "ForwardBatch": ".forward_batch",
}

__all__ = ["LLM", "ArtifactError", "CompletionOutput", "EngineCore", "ForwardBatch", "IncrementalDetokenizer", "KilnRuntimeError",
           "LLMEngine", "LoadedArtifact", "Logprob", "RequestError", "RequestOutput", "SamplingParams", "Tokenizer",
           "load_artifact"]

threads.prefer_passive_openmp()  # before anything loads torch (threads.py says why)

if TYPE_CHECKING:
    from .artifact import LoadedArtifact, load_artifact
    from .core.engine import EngineCore
    from .forward_batch import ForwardBatch
    from .llm import LLM
    from .llm_engine import LLMEngine
    from .tokenizer import IncrementalDetokenizer, Tokenizer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
