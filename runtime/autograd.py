"""PyTorch autograd nodes for a step: forward, exact adjoint, dt derivatives, jvp, vmap.

The operator is affine in (u, start) and smooth in dt, so:
* backward to (u, start) is the generated adjoint kernel, itself a differentiable node
  whose backward is the forward kernel (double backward);
* backward to dt is the generated dt_vjp kernel (first order only: asking for a second
  derivative through dt raises, it never returns a silent zero);
* jvp is the generated dt_jvp kernel (tangents of u, start and dt in one pass);
* vmap folds the vmapped dimension into the batch (a loop where dt or idx are vmapped).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .launch import Launcher

Tensor = torch.Tensor
OptTensor = Optional[Tensor]

NO_SECOND_DT = (
    "tensorstep: second derivatives with respect to dt are not supported "
    "(first-order gradients and jvp are exact); detach dt for double backward / hessians"
)


def _zeros_like_or(t: OptTensor, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if t is None else t


def scatter_start(grad_per_batch: Tensor, idx: OptTensor, rows: int) -> Tensor:
    """Per-batch start gradients [B, D] → start rows [S, D] (sum over batch elements sharing a row)."""
    if idx is None:
        return grad_per_batch
    out = grad_per_batch.new_zeros((rows, grad_per_batch.shape[1]))
    return out.index_add(0, idx, grad_per_batch)


class _FastApply(torch.autograd.Function):
    """Function.apply without per-call inspect.signature binding (ours take no defaults).

    Outside functorch transforms torch binds default arguments with inspect on every call,
    which costs more than a small kernel; inside transforms torch's own path is kept.
    """

    @classmethod
    def apply(cls, *args):  # type: ignore[override]
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        args = torch._functorch.utils.unwrap_dead_wrappers(args)
        return super(torch.autograd.Function, cls).apply(*args)


class StepFunction(_FastApply):
    """(u, p0, v0, a0, j0, idx, dt) → (P, V, A, J[, S]) as one autograd node."""

    @staticmethod
    def forward(launcher: Launcher, u, p0, v0, a0, j0, idx, dt):  # type: ignore[override]
        return tuple(launcher.forward(u, (p0, v0, a0, j0), idx, dt))

    @staticmethod
    def setup_context(ctx, inputs, output):
        launcher, u, p0, v0, a0, j0, idx, dt = inputs
        ctx.launcher = launcher
        ctx.save_for_backward(u, p0, v0, a0, j0, idx, dt)
        ctx.save_for_forward(u, p0, v0, a0, j0, idx, dt)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        launcher: Launcher = ctx.launcher
        u, p0, v0, a0, j0, idx, dt = ctx.saved_tensors
        need = ctx.needs_input_grad
        out: list[OptTensor] = [None] * 8
        if all(g is None for g in grads):
            return tuple(out)
        starts = (p0, v0, a0, j0)
        if any(need[1:6]):
            if torch.is_grad_enabled():  # create_graph: keep the adjoint differentiable
                gu, *gs = AdjointFunction.apply(launcher, dt, u.shape[0], *grads)
            else:  # plain backward: straight to the kernel, start gradients only where needed
                gu, gs = launcher.adjoint(grads, dt, u.shape[0], need[2:6])
            out[1] = gu if need[1] else None
            for m, start in enumerate(starts):
                if need[2 + m]:
                    out[2 + m] = scatter_start(gs[m], idx, start.shape[0])
        if need[7]:
            out[7] = DtVjpFunction.apply(launcher, u, p0, v0, a0, j0, idx, dt, *grads).to(dt.dtype)
        return tuple(out)

    @staticmethod
    def jvp(ctx, _launcher, du, dp0, dv0, da0, dj0, _didx, ddt):
        # Routed through Functions (not raw kernels) so that vmap-over-jvp (jacfwd) works.
        launcher: Launcher = ctx.launcher
        u, p0, v0, a0, j0, idx, dt = ctx.saved_tensors
        if ddt is not None:
            return DtJvpFunction.apply(launcher, u, p0, v0, a0, j0, idx, dt, du, dp0, dv0, da0, dj0, ddt)
        # affine in (u, start): the tangent is the step applied to the tangents
        du = _zeros_like_or(du, u)
        dp0, dv0, da0 = (_zeros_like_or(t, s) for t, s in ((dp0, p0), (dv0, v0), (da0, a0)))
        return StepFunction.apply(launcher, du, dp0, dv0, da0, dj0, idx, dt)

    @staticmethod
    def vmap(info, in_dims, launcher, u, p0, v0, a0, j0, idx, dt):
        return vmap_step(info, in_dims, launcher, u, (p0, v0, a0, j0), idx, dt)


class AdjointFunction(_FastApply):
    """(grads of P, V, A, J[, S]) → (gu, per-batch gp0, gv0, ga0, gj0); linear in the grads."""

    @staticmethod
    def forward(launcher: Launcher, dt, B, *grads):  # type: ignore[override]
        gu, gs = launcher.adjoint(grads, dt, B, (True, True, True, True))
        return (gu, *gs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        launcher, dt, B = inputs[:3]
        ctx.launcher, ctx.B = launcher, B
        ctx.present = tuple(g is not None for g in inputs[3:])  # gradients only for tensors given
        ctx.save_for_backward(dt)
        ctx.save_for_forward(dt)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, ggu, *ggs):
        if ctx.needs_input_grad[1]:
            raise RuntimeError(NO_SECOND_DT)
        (dt,) = ctx.saved_tensors
        launcher: Launcher = ctx.launcher
        grads = _apply_forward(launcher, ctx.B, ggu, ggs, dt)
        return (None, None, None, *(g if present else None for g, present in zip(grads, ctx.present)))

    @staticmethod
    def jvp(ctx, _launcher, ddt, _dB, *dgrads):
        if ddt is not None:
            raise RuntimeError(NO_SECOND_DT)
        (dt,) = ctx.saved_tensors
        return AdjointFunction.apply(ctx.launcher, dt, ctx.B, *dgrads)  # linear in the grads

    @staticmethod
    def vmap(info, in_dims, launcher, dt, B, *grads):
        if in_dims[1] is not None:
            return vmap_by_loop(AdjointFunction.apply, info, in_dims, (launcher, dt, B, *grads))
        V = info.batch_size
        flat = [_fold(g, d, V) for g, d in zip(grads, in_dims[3:])]
        outs = AdjointFunction.apply(launcher, dt, V * B, *flat)
        return tuple(o.reshape(V, B, *o.shape[1:]) for o in outs), (0,) * len(outs)


def _apply_forward(launcher: Launcher, B: int, gu: OptTensor, gs: Sequence[OptTensor], dt: Tensor) -> tuple:
    """The adjoint's own adjoint: the forward operator on (gu, per-batch start), no index."""
    inputs = launcher.forward_inputs(B, gu, gs)
    if inputs is None:
        return (None,) * launcher.K
    return StepFunction.apply(launcher, *inputs, None, dt)


class _FirstOrderOnly(_FastApply):
    """A dt-derivative node: exact to first order; differentiating it again raises (never a silent zero)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(NO_SECOND_DT)

    @staticmethod
    def jvp(ctx, *_):
        raise RuntimeError(NO_SECOND_DT)

    @classmethod
    def vmap(cls, info, in_dims, *args):
        return vmap_by_loop(cls.apply, info, in_dims, args)


class DtVjpFunction(_FirstOrderOnly):
    """Gradient with respect to the kernel's dt vector."""

    @staticmethod
    def forward(launcher: Launcher, u, p0, v0, a0, j0, idx, dt, *grads):  # type: ignore[override]
        return launcher.dt_vjp(u, (p0, v0, a0, j0), idx, grads, dt)


class DtJvpFunction(_FirstOrderOnly):
    """Output tangents when dt has a tangent too: Ṁ x + M ẋ in one generated kernel."""

    @staticmethod
    def forward(launcher: Launcher, u, p0, v0, a0, j0, idx, dt, du, dp0, dv0, da0, dj0, ddt):  # type: ignore[override]
        return tuple(launcher.dt_jvp(u, (p0, v0, a0, j0), idx, du, (dp0, dv0, da0, dj0), dt, ddt.contiguous()))


# ---- vmap helpers ------------------------------------------------------------------------------

def _fold(t: OptTensor, dim: Optional[int], V: int) -> OptTensor:
    """Move the vmapped dim to the front (expanding unbatched inputs) and merge it with the batch."""
    if t is None:
        return None
    t = t.movedim(dim, 0) if dim is not None else t.unsqueeze(0).expand(V, *t.shape)
    return t.reshape(V * t.shape[1], *t.shape[2:]).contiguous()


def vmap_by_loop(apply: Callable, info: Any, in_dims: Sequence[Optional[int]], args: Sequence[Any]):
    """Generic vmap rule: one call per vmapped element, outputs stacked on dim 0."""
    results = []
    for v in range(info.batch_size):
        sliced = [a.select(d, v) if (d is not None and isinstance(a, Tensor)) else a for a, d in zip(args, in_dims)]
        results.append(apply(*sliced))
    if isinstance(results[0], Tensor):
        return torch.stack(results), 0
    stacked = tuple(torch.stack(parts) for parts in zip(*results))
    return stacked, (0,) * len(stacked)


def vmap_step(info, in_dims, launcher: Launcher, u, starts, idx, dt):
    """Fold the vmapped dim into the batch; loop when dt or the start index are vmapped."""
    _, u_dim, *start_dims, idx_dim, dt_dim = in_dims
    args = (launcher, u, *starts, idx, dt)
    if dt_dim is not None or idx_dim is not None:
        return vmap_by_loop(StepFunction.apply, info, in_dims, args)
    V = info.batch_size
    u_b = u.movedim(u_dim, 0) if u_dim is not None else u.unsqueeze(0).expand(V, *u.shape)
    B = u_b.shape[1]
    u_flat = u_b.reshape(V * B, *u_b.shape[2:]).contiguous()
    if idx is None:
        flat_starts = [_fold(s, d, V) for s, d in zip(starts, start_dims)]
        idx_flat = None
    elif all(d is None for d in start_dims):
        flat_starts = list(starts)
        idx_flat = idx.repeat(V)
    else:
        S = next(s for s in starts if s is not None).shape[0]
        flat_starts = [_fold(s, d, V) for s, d in zip(starts, start_dims)]
        offsets = torch.arange(V, device=idx.device, dtype=idx.dtype).unsqueeze(1) * S
        idx_flat = (idx.unsqueeze(0) + offsets).reshape(-1)
    outs = StepFunction.apply(launcher, u_flat, *flat_starts, idx_flat, dt)
    return tuple(o.reshape(V, B, *o.shape[1:]) for o in outs), (0,) * len(outs)
