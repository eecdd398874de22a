"""tensorstep: generated, differentiable trajectory step kernels for robot motion optimisation."""
from __future__ import annotations

__version__ = "0.1.0"

from .codegen.spec import KernelSpec  # noqa: E402  (light: no SymPy)
from .runtime.api import load, operator_matrices, source  # noqa: E402

__all__ = ["KernelSpec", "load", "operator_matrices", "source", "__version__"]
