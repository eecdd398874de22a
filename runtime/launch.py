"""Launching a spec's four kernels on torch tensors (allocation, pointers, layouts).

Inputs are assumed validated (runtime.validate) and contiguous. The backend object
supplies ``call(kernel, B, args)`` for C (cffi) or CUDA (CuPy); everything else here is
backend-neutral.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch

Tensor = torch.Tensor
OptTensor = Optional[Tensor]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def ptr(t: OptTensor) -> int:
    return 0 if t is None else t.data_ptr()


def contiguous(t: OptTensor) -> OptTensor:
    return None if t is None else t.contiguous()


class Launcher:
    """The four entry points of one spec on one device."""

    def __init__(self, spec: Any, backend: Any):
        self.spec = spec
        self.backend = backend
        self.dtype = DTYPES[spec.dtype]
        self.K = spec.order + 1

    def _shape(self, B: int, rows: int) -> tuple[int, int, int]:
        D = self.spec.dof
        return (B, rows, D) if self.spec.layout == "bhd" else (B, D, rows)

    def output_shape(self, B: int) -> tuple[int, int, int]:
        """Shape of each output (P, V, A, J[, S]) for a batch of B."""
        return self._shape(B, self.spec.horizon)

    def action_shape(self, B: int) -> tuple[int, int, int]:
        """Shape of the actions u (and of their gradient) for a batch of B."""
        return self._shape(B, self.spec.n_actions)

    def forward_inputs(self, B: int, gu: OptTensor, gs: Sequence[OptTensor]) -> Optional[list[Tensor]]:
        """(u, p0, v0, a0, j0) for running the forward on adjoint-shaped tensors (double
        backward): missing ones become zeros, all contiguous; None when all are missing."""
        like = next((g for g in (gu, *gs) if g is not None), None)
        if like is None:
            return None
        u = gu.contiguous() if gu is not None else like.new_zeros(self.action_shape(B))
        return [u] + [g.contiguous() if g is not None else like.new_zeros((B, self.spec.dof)) for g in gs]

    def _empty_outputs(self, like: Tensor, B: int) -> list[Tensor]:
        return [torch.empty(self.output_shape(B), dtype=self.dtype, device=like.device) for _ in range(self.K)]

    def forward(self, u: Tensor, start: Sequence[OptTensor], idx: OptTensor, dt: Tensor,
                out: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
        """Outputs (P, V, A, J[, S]): new tensors, or ``out`` (validated by the caller) written in place."""
        B = u.shape[0]
        ys = list(out) if out is not None else self._empty_outputs(u, B)
        if B:
            self.backend.call("forward", B, [ptr(u), *map(ptr, start), ptr(idx), ptr(dt), *map(ptr, ys)])
        return ys

    def adjoint(
        self, grads: Sequence[OptTensor], dt: Tensor, B: int, start_needed: Sequence[bool]
    ) -> tuple[Tensor, list[OptTensor]]:
        """(gu, per-batch start gradients [B, D] or None where not needed)."""
        grads = [contiguous(g) for g in grads]
        like = next(g for g in grads if g is not None)
        D = self.spec.dof
        gu = torch.empty(self.action_shape(B), dtype=self.dtype, device=like.device)
        gs = [torch.empty((B, D), dtype=self.dtype, device=like.device) if need else None for need in start_needed]
        if B:
            self.backend.call("adjoint", B, [*map(ptr, grads), ptr(dt), ptr(gu), *map(ptr, gs)])
        return gu, gs

    def dt_vjp(
        self, u: Tensor, start: Sequence[OptTensor], idx: OptTensor, grads: Sequence[OptTensor], dt: Tensor
    ) -> Tensor:
        """Gradient with respect to the dt vector the kernel reads (float64, summed over the batch)."""
        grads = [contiguous(g) for g in grads]
        gc = torch.zeros(self.backend.n_coefficients, dtype=torch.float64, device=u.device)
        gdt = torch.empty(self.spec.n_dt, dtype=torch.float64, device=u.device)
        B = u.shape[0]
        if B:
            self.backend.call("dt_vjp", B, [ptr(u), *map(ptr, start), ptr(idx), *map(ptr, grads), ptr(dt), ptr(gc)])
        self.backend.call("dt_vjp_finish", 1, [ptr(dt), ptr(gc), ptr(gdt)])
        return gdt

    def dt_jvp(
        self,
        u: Tensor,
        start: Sequence[OptTensor],
        idx: OptTensor,
        du: OptTensor,
        dstart: Sequence[OptTensor],
        dt: Tensor,
        ddt: Tensor,
    ) -> list[Tensor]:
        B = u.shape[0]
        ys = self._empty_outputs(u, B)
        du = contiguous(du)
        dstart = [contiguous(t) for t in dstart]
        if B:
            self.backend.call(
                "dt_jvp", B, [ptr(u), *map(ptr, start), ptr(idx), ptr(du), *map(ptr, dstart), ptr(dt), ptr(ddt), *map(ptr, ys)]
            )
        return ys


class CpuBackend:
    """Calls into cffi-loaded libraries: the core now, the dt derivatives on first use."""

    def __init__(self, spec: Any, source: Optional[str] = None):
        """Kernels generated for ``spec``, or built from a given C ``source`` (all kernels)."""
        from .cbackend import load_library, load_source

        self.spec = spec
        self._load = load_library if source is None else (lambda spec, part: load_source(spec, source))
        self.functions: dict[str, Any] = {}
        self._core = self._bind("core" if source is None else "all")

    def _bind(self, part: str) -> Any:
        from ..codegen import abi

        lib = self._load(self.spec, part)
        self.functions.update({k: getattr(lib, abi.symbol(self.spec.name, k)) for k in abi.PARTS[part]})
        return lib

    def address(self, kernel: str) -> int:
        """Address of a core kernel ('forward', 'adjoint'), for the native autograd node."""
        from ..codegen import abi
        from .cbackend import address

        return address(self._core, abi.symbol(self.spec.name, kernel))

    @functools.cached_property
    def n_coefficients(self) -> int:
        from ..codegen import abi

        lib = self._bind("dt")
        return int(getattr(lib, abi.symbol(self.spec.name, "n_coefficients"))())

    def call(self, kernel: str, B: int, args: list[int]) -> None:
        if kernel not in self.functions:
            self._bind("dt")
        self.functions[kernel](B, *args)
