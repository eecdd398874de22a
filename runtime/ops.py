"""torch.library custom ops: how torch.compile sees a step (no graph breaks).

``tensorstep::step`` (forward), ``tensorstep::step_adjoint`` and ``tensorstep::step_dt_vjp``
take a kernel key (a constant string naming a loaded spec on a device) plus tensors. Each has
a fake kernel (shapes only), the forward's autograd calls the adjoint op, the adjoint's
autograd calls the forward op (double backward), and the forward has a vmap rule.
Value checks that need the data (index range, dt) run inside the op implementations.

Importing this module registers the ops (6–10 ms, mostly inside ``torch.library.custom_op``),
so ``Step`` imports it only when torch.compile first traces a step (``api._custom_ops``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import validate
from .autograd import NO_SECOND_DT, scatter_start
from .registry import launcher as _launcher


@torch.library.custom_op("tensorstep::step", mutates_args=())
def step(key: str, u: Tensor, p0: Tensor, v0: Tensor, a0: Tensor, j0: Optional[Tensor],
         idx: Optional[Tensor], dt: Tensor) -> list[Tensor]:
    if u.device.type == "cpu":
        if idx is not None:
            validate.check_index_values(idx, p0.shape[0])
        validate.check_dt_values(dt)
    return _launcher(key).forward(u, (p0, v0, a0, j0), idx, dt)


@step.register_fake
def _(key, u, p0, v0, a0, j0, idx, dt):
    launcher = _launcher(key)
    shape = launcher.output_shape(u.shape[0])
    return [u.new_empty(shape) for _ in range(launcher.K)]


@torch.library.custom_op("tensorstep::step_adjoint", mutates_args=())
def step_adjoint(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor) -> list[Tensor]:
    """(gu, per-batch gp0, gv0, ga0, gj0) for output gradients (None = unused output)."""
    launcher = _launcher(key)
    if all(g is None for g in grads):
        gu = dt.new_zeros(launcher.action_shape(batch))
        return [gu] + [dt.new_zeros((batch, launcher.spec.dof)) for _ in range(4)]
    gu, gs = launcher.adjoint(grads, dt, batch, (True,) * 4)
    return [gu, *gs]


@step_adjoint.register_fake
def _(key, batch, grads, dt):
    launcher = _launcher(key)
    return [dt.new_empty(launcher.action_shape(batch))] + [
        dt.new_empty((batch, launcher.spec.dof)) for _ in range(4)
    ]


@torch.library.custom_op("tensorstep::step_dt_vjp", mutates_args=())
def step_dt_vjp(key: str, u: Tensor, p0: Tensor, v0: Tensor, a0: Tensor, j0: Optional[Tensor],
                idx: Optional[Tensor], dt: Tensor, grads: list[Optional[Tensor]]) -> Tensor:
    return _launcher(key).dt_vjp(u, (p0, v0, a0, j0), idx, grads, dt).to(dt.dtype)


@step_dt_vjp.register_fake
def _(key, u, p0, v0, a0, j0, idx, dt, grads):
    return dt.new_empty(dt.shape)


# ---- autograd -----------------------------------------------------------------------------------

def _step_setup(ctx, inputs, output):
    key, u, p0, v0, a0, j0, idx, dt = inputs
    ctx.key = key
    ctx.has_j0 = j0 is not None
    ctx.save_for_backward(u, p0, v0, a0, j0, idx, dt)


def _step_backward(ctx, grads):
    u, p0, v0, a0, j0, idx, dt = ctx.saved_tensors
    need = ctx.needs_input_grad
    out: list[Optional[Tensor]] = [None] * 8
    if any(need[1:6]):
        gu, *gs = step_adjoint(ctx.key, u.shape[0], list(grads), dt)
        out[1] = gu
        for m, start in enumerate((p0, v0, a0, j0)):
            if need[2 + m] and start is not None:
                out[2 + m] = scatter_start(gs[m], idx, start.shape[0])
    if need[7]:
        out[7] = step_dt_vjp(ctx.key, u, p0, v0, a0, j0, idx, dt, list(grads))
    return tuple(out)


step.register_autograd(_step_backward, setup_context=_step_setup)


def _adjoint_setup(ctx, inputs, output):
    key, batch, grads, dt = inputs
    ctx.key, ctx.batch = key, batch
    ctx.present = [g is not None for g in grads]
    ctx.save_for_backward(dt)


def _adjoint_backward(ctx, outs_grads):
    if ctx.needs_input_grad[3]:
        raise RuntimeError(NO_SECOND_DT)
    (dt,) = ctx.saved_tensors
    ggu, *ggs = outs_grads
    inputs = _launcher(ctx.key).forward_inputs(ctx.batch, ggu, ggs)
    if inputs is None:
        return None, None, None, None
    outs = step(ctx.key, *inputs, None, dt)
    return None, None, [y if present else None for y, present in zip(outs, ctx.present)], None


step_adjoint.register_autograd(_adjoint_backward, setup_context=_adjoint_setup)


# ---- vmap ---------------------------------------------------------------------------------------

def _step_vmap(info, in_dims, key, u, p0, v0, a0, j0, idx, dt):
    from .autograd import _fold

    _, u_dim, *start_dims, idx_dim, dt_dim = in_dims
    V = info.batch_size
    if dt_dim is not None or idx_dim is not None or idx is not None:
        results = []
        for v in range(V):
            pick = lambda t, d: t.select(d, v) if (t is not None and d is not None) else t
            results.append(step(key, pick(u, u_dim), *(pick(s, d) for s, d in zip((p0, v0, a0, j0), start_dims)),
                                pick(idx, idx_dim), pick(dt, dt_dim)))
        outs = [torch.stack(parts) for parts in zip(*results)]
        return outs, [0] * len(outs)
    flat = [_fold(t, d, V) for t, d in zip((u, p0, v0, a0, j0), (u_dim, *start_dims))]
    B = flat[0].shape[0] // V
    outs = step(key, *flat, None, dt)
    return [o.reshape(V, B, *o.shape[1:]) for o in outs], [0] * len(outs)


torch.library.register_vmap("tensorstep::step", _step_vmap)
