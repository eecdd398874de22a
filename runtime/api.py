"""The public API: load a compiled step, read its source, get its dense matrices."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from ..codegen.spec import KernelSpec
from . import registry, validate
from .autograd import StepFunction
from .launch import DTYPES, CpuBackend, Launcher

Tensor = torch.Tensor


class Step(torch.nn.Module):
    """A compiled trajectory step: ``P, V, A, J = step(u, p0, v0, a0, dt=..., j0=..., start_index=...)``.

    ``out=(P, V, A, J)`` writes the forward into caller-owned tensors instead (rollouts under
    ``torch.no_grad()``; not differentiable, like PyTorch's own ``out=`` functions).
    """

    def __init__(self, spec: Any, device: torch.device, launcher: Launcher):
        super().__init__()
        self.spec = spec
        self.device = device
        self.launcher = launcher
        self.dtype = DTYPES[spec.dtype]
        self.op_key = registry.register(launcher, device)
        self._dt_cache: dict[float, Tensor] = {}
        self.native: Optional[int] = None  # handle of the native autograd node (CPU), if built
        if device.type == "cpu":
            from . import native

            self.native = native.handle(launcher)
        self._native_step = torch.ops.tensorstep_native.step.default if self.native is not None else None
        self._native_checked = torch.ops.tensorstep_native.checked_step.default if self.native is not None else None
        self._native_checked_out = (torch.ops.tensorstep_native.checked_step_out.default
                                    if self.native is not None else None)

    def extra_repr(self) -> str:
        return f"{self.spec.name}, device={self.device}"

    def __reduce__(self):
        # pickle and deepcopy by spec (loaded libraries and ops are per process)
        return load, (self.spec, str(self.device))

    def _dt_tensor(self, dt: Union[float, Tensor]) -> Tensor:
        """The kernel's dt vector; tensors for repeated Python floats are reused (cheap calls)."""
        if isinstance(dt, float) and not torch.compiler.is_compiling():
            cached = self._dt_cache.get(dt)
            if cached is None:
                cached = validate.dt_tensor(dt, self.spec.n_dt, self.spec.horizon, self.dtype, self.device)
                if len(self._dt_cache) < 64:
                    self._dt_cache[dt] = cached
            return cached
        return validate.dt_tensor(dt, self.spec.n_dt, self.spec.horizon, self.dtype, self.device)

    def action_shape(self, batch: int) -> tuple[int, int, int]:
        """Shape the actions u must have for a batch of ``batch`` trajectories."""
        return self.launcher.action_shape(batch)

    def forward(
        self,
        u: Tensor,
        p0: Tensor,
        v0: Tensor,
        a0: Tensor,
        dt: Union[float, Tensor],
        *,
        j0: Optional[Tensor] = None,
        start_index: Optional[Tensor] = None,
        out: Optional[Sequence[Tensor]] = None,
    ) -> tuple[Tensor, ...]:
        if (self.native is not None
                and type(u) is Tensor and type(p0) is Tensor and type(v0) is Tensor and type(a0) is Tensor
                and (j0 is None or type(j0) is Tensor) and (start_index is None or type(start_index) is Tensor)
                and not torch.compiler.is_compiling() and not _forward_mode_active()):
            # the common call: the native op checks the tensors and the values of dt and start_index
            # itself (an empty or false result means something is off, and the checks below say
            # what); a float dt comes as the tensor cached for it
            dt_k = dt if type(dt) is Tensor else self._dt_cache.get(dt) if type(dt) is float else None
            if dt_k is not None:
                if out is None:
                    outs = self._native_checked(self.native, u, p0, v0, a0, j0, start_index, dt_k)
                    if outs:
                        return tuple(outs)
                elif (type(out) in (tuple, list) and all(type(y) is Tensor for y in out)
                      and self._native_checked_out(self.native, u, p0, v0, a0, j0, start_index, dt_k, out)):
                    return tuple(out)
        spec = self.spec
        B = validate.check_batch(u)
        validate.check_tensor("u", u, self.action_shape(B), self.dtype, self.device)
        if spec.start_index != (start_index is not None):
            need = "needs a" if spec.start_index else "takes no"
            raise ValueError(f"start_index: this kernel (start_index={spec.start_index}) {need} start_index argument")
        S = validate.start_rows(p0, B, spec.start_index)
        for name, t in (("p0", p0), ("v0", v0), ("a0", a0)):
            validate.check_tensor(name, t, (S, spec.dof), self.dtype, self.device)
        if j0 is not None:
            validate.check_tensor("j0", j0, (S, spec.dof), self.dtype, self.device)
        idx = validate.check_index(start_index, B, S, self.device) if start_index is not None else None
        dt_k = self._dt_tensor(dt)
        if out is not None:
            return self._into(out, u, p0, v0, a0, j0, start_index, idx, dt_k)
        if torch.compiler.is_compiling():
            if _forward_mode_active():
                # torch.library custom ops carry no forward-mode rule: never return a silent zero
                raise RuntimeError(
                    "tensorstep: forward-mode AD (jvp, jacfwd, hessian) inside torch.compile is not supported; "
                    "call the step outside the compiled region for forward mode (eager jvp is exact)"
                )
            _custom_ops()
            return tuple(torch.ops.tensorstep.step(self.op_key, u, p0, v0, a0, j0, idx, dt_k))
        if self.native is not None and not dt_k.requires_grad and not _forward_mode_active():
            return tuple(self._native_step(self.native, u, p0, v0, a0, j0, idx, dt_k))
        return StepFunction.apply(self.launcher, u, p0, v0, a0, j0, idx, dt_k)


    def _into(self, out: Any, u: Tensor, p0: Tensor, v0: Tensor, a0: Tensor, j0: Optional[Tensor],
              start_index: Optional[Tensor], idx: Optional[Tensor], dt_k: Tensor) -> tuple[Tensor, ...]:
        """The forward written into caller-owned outputs (rollouts: no allocation, no page faults)."""
        inputs = {"u": u, "p0": p0, "v0": v0, "a0": a0, "j0": j0, "start_index": start_index, "dt": dt_k}
        shape = self.launcher.output_shape(u.shape[0])
        out = validate.check_out(out, self.launcher.K, shape, self.dtype, self.device, inputs)
        if torch.compiler.is_compiling():
            _custom_ops()
            for y, value in zip(out, torch.ops.tensorstep.step(self.op_key, u, p0, v0, a0, j0, idx, dt_k)):
                y.copy_(value)
            return out
        self.launcher.forward(u, (p0, v0, a0, j0), idx, dt_k, out=out)
        for y in out:  # the kernel wrote through raw pointers: tell autograd the tensors changed
            torch.autograd.graph.increment_version(y)
        return out


def _custom_ops() -> bool:
    """Registers the torch.library ops that torch.compile traces, once per process.

    Dynamo calls a function marked as a constant while tracing, outside the graph, so the
    registration's cost (6–10 ms here) falls on a process's first compilation, not on every load.
    """
    from . import ops  # noqa: F401  (importing registers them)

    return True


# what torch.compiler.assume_constant_result(_custom_ops) sets, without importing Dynamo (and
# SymPy with it) on every load; tests/test_compile.py checks the two stay the same
_custom_ops._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _forward_mode_active() -> bool:
    """A functorch transform (jvp, jacfwd, vmap over them) or a forward-AD dual level is live."""
    # (both predicates also evaluate correctly while dynamo traces)
    return torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0


def _device(device: Union[str, torch.device]) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from .cuda_backend import CudaUnavailable

        raise CudaUnavailable(
            f"device={str(device)!r}: this PyTorch build sees no CUDA device (torch.cuda.is_available() is False); "
            "install a CUDA build of PyTorch and CuPy (pip install tensorstep[cuda]) on a machine with an NVIDIA GPU"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid: allowed 'cpu', 'cuda', 'cuda:N'")
    return dev


def load(spec: Any, device: Union[str, torch.device] = "cpu") -> Step:
    """Compile (or load from the cache) the kernels of a spec for a device."""
    dev = _device(device)
    if dev.type == "cpu":
        backend: Any = CpuBackend(spec)
    else:
        from .cuda_backend import CudaBackend

        backend = CudaBackend(spec, dev)
    return Step(spec, dev, Launcher(spec, backend))


def source(spec: Any, target: str = "c") -> str:
    """The generated source text ('c', 'cuda' or 'header')."""
    from ..codegen.render import render

    return render(spec, target)


def operator_matrices(spec: Any, dt: Union[float, Sequence[float]]) -> dict[str, Any]:
    """Dense float64 matrices of the operator at the given step durations.

    Returns ``{"u": M_u [K, H, N], "start": M_s [K, H, 4]}`` with
    ``Y_k = M_u[k] @ u + M_s[k] @ (p0, v0, a0, j0)`` for one (batch, dof) column.
    """
    from ..codegen.schemes import build_operator

    values = [float(dt)] if isinstance(dt, (int, float)) else [float(x) for x in dt]
    if len(values) != spec.n_dt:
        raise ValueError(f"dt: expected {spec.n_dt} value(s) for dt={getattr(spec, 'dt', '?')!r}, got {len(values)}")
    for v in values:
        if not (v > 0 and v < float("inf")):
            raise ValueError(f"dt: expected finite, positive step durations, got {v!r}")
    builder = getattr(spec, "build_operator", None)
    op = builder() if builder else build_operator(spec)
    m_u, m_s = op.dense(values)
    return {"u": m_u, "start": m_s}


__all__ = ["KernelSpec", "Step", "load", "source", "operator_matrices"]
