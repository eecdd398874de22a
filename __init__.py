"""tensorstep: generated, differentiable trajectory step kernels for robot motion optimisation.

``import tensorstep`` is light: the runtime (and PyTorch with it) is imported on first use of
``load``, ``operator_matrices``, ``register_ops``, ``Step`` or ``empty_cache``, so the command line's
code-only commands never import PyTorch; ``source`` imports neither PyTorch nor, where the kernel
cache keeps the text, the generator (runtime/sources.py).
"""
from __future__ import annotations

import importlib
from typing import Any

from .codegen.spec import KernelSpec
from .version import __version__

_RUNTIME = ("load", "operator_matrices", "register_ops", "Step")
#: runtime/memory.py: the large CPU outputs' cache (``empty_cache`` as ``torch.cuda.empty_cache``)
_MEMORY = ("empty_cache",)
#: runtime/sources.py: the generated source, without PyTorch
_SOURCES = ("source",)


def __getattr__(name: str) -> Any:
    for names, module in ((_RUNTIME, "api"), (_MEMORY, "memory"), (_SOURCES, "sources")):
        if name in names:
            value = getattr(importlib.import_module(f".runtime.{module}", __name__), name)
            globals()[name] = value  # later look-ups skip this function
            return value
    raise AttributeError(f"module 'tensorstep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_RUNTIME) | set(_MEMORY) | set(_SOURCES))


__all__ = ["KernelSpec", "Step", "empty_cache", "load", "operator_matrices", "register_ops", "source", "__version__"]
