"""kiln: a compiler-driven LLM serving framework.

    import kiln
    kiln.compile("examples/tiny_llama.dsl", out_dir="build/tiny")     # recipe -> serving artifact
    llm = kiln.LLM("build/tiny")
    llm.generate(["Once upon a time"], kiln.SamplingParams(max_tokens=32))
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "LLM", "SamplingParams", "__version__"]

_LAZY = {
    "compile": ("kiln.driver", "compile"),
    "LLM": ("kiln.runtime.llm", "LLM"),
    "SamplingParams": ("kiln.runtime.sampling_params", "SamplingParams"),
}


def __getattr__(name: str) -> Any:  # lazy: `kiln serve` need not import the compiler, nor vice versa
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
