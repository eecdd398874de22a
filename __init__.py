"""tensorstep: generated, differentiable trajectory step kernels for robot motion optimisation.

``import tensorstep`` is light: the runtime (and PyTorch with it) is imported on first use of
``load``, ``source``, ``operator_matrices``, ``register_ops``, ``Step`` or ``empty_cache``, so the command
line's code-only commands never import PyTorch.
"""
from __future__ import annotations

from typing import Any

from .codegen.spec import KernelSpec
from .version import __version__

_RUNTIME = ("load", "source", "operator_matrices", "register_ops", "Step")
#: runtime/memory.py: the large CPU outputs' cache (``empty_cache`` as ``torch.cuda.empty_cache``)
_MEMORY = ("empty_cache",)


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        from .runtime import api

        value = getattr(api, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in _MEMORY:
        from .runtime import memory

        value = getattr(memory, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tensorstep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_RUNTIME) | set(_MEMORY))


__all__ = ["KernelSpec", "Step", "empty_cache", "load", "operator_matrices", "register_ops", "source", "__version__"]
