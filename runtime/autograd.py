"""PyTorch autograd nodes for a step (eager mode): forward, exact adjoint, dt derivatives.

The operator is affine in its tensor inputs and smooth in dt, so:
* backward to the tensor inputs is the generated adjoint kernel, itself a differentiable node
  whose backward is the forward kernel (double backward);
* backward to dt is the generated dt_vjp kernel (first order only: asking for a second
  derivative through dt raises, it never returns a silent zero);
* jvp runs the step on the tangents, or the generated dt_jvp kernel when dt has a tangent;
* vmap folds the vmapped dimension into the batch.
The rules themselves live in runtime/rules.py, shared with the custom ops.
"""
from __future__ import annotations

from typing import Any

import torch

from . import rules
from .launch import Launcher

Tensor = torch.Tensor

NO_SECOND_DT = (
    "tensorstep: second derivatives with respect to dt are not supported "
    "(first-order gradients and jvp are exact); detach dt for double backward / hessians"
)


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
    """(inputs in table order, dt) → outputs (P, V, A, J[, S]) as one autograd node."""

    @staticmethod
    def forward(launcher: Launcher, *args):  # type: ignore[override]
        *inputs, dt = args
        return tuple(launcher.forward(inputs, dt))

    @staticmethod
    def setup_context(ctx, inputs, output):
        launcher, *args = inputs
        ctx.launcher = launcher
        ctx.save_for_backward(*args)
        ctx.save_for_forward(*args)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        *inputs, dt = ctx.saved_tensors
        return (None, *_backward(ctx.launcher, inputs, dt, grads, ctx.needs_input_grad[1:]))

    @staticmethod
    def jvp(ctx, _launcher, *tangents):
        # Routed through Functions (not raw kernels) so that vmap-over-jvp (jacfwd) works.
        launcher: Launcher = ctx.launcher
        *inputs, dt = ctx.saved_tensors

        def dt_jvp(input_tangents, ddt):
            return DtJvpFunction.apply(launcher, dt, ddt.contiguous(), *inputs, *input_tangents)

        return rules.jvp(launcher.table, inputs, tangents[:-1], dt, tangents[-1],
                         lambda *args: StepFunction.apply(launcher, *args), dt_jvp)

    @staticmethod
    def vmap(info, in_dims, launcher, *args):
        return rules.vmap(launcher.table, info.batch_size, in_dims[1:], args[:-1], args[-1],
                          lambda *a: StepFunction.apply(launcher, *a))


def _backward(launcher: Launcher, inputs: list, dt: Tensor, grads: tuple, needs: tuple) -> list:
    """The gradients of every input in table order, then dt's, given the outputs' (``needs``: which want one)."""
    B = inputs[0].shape[0]
    if launcher.table.fused and (torch.is_grad_enabled() or needs[-1]):
        return _recomputed(launcher, inputs, dt, grads, needs)

    def adjoint(needed):
        if torch.is_grad_enabled() and not launcher.table.fused:  # create_graph: keep the adjoint differentiable
            return AdjointFunction.apply(launcher, dt, B, *grads)
        return launcher.adjoint(grads, dt, B, needed, inputs)

    def dt_vjp() -> Tensor:
        return DtVjpFunction.apply(launcher, dt, *inputs, *grads).to(dt.dtype)

    return rules.backward(launcher.table, inputs, grads, needs, adjoint, dt_vjp)


def step_function(launcher: Launcher, inputs: list, dt: Tensor) -> tuple[Tensor, ...]:
    """The Python path's autograd node of one call (inputs in table order): ``StepFunction``, or for
    a step with cost parameters ``FusedStepFunction``."""
    if launcher.parameter_places:
        return FusedStepFunction.apply(launcher, tuple(inputs[i] for i in launcher.parameter_places),
                                       *(inputs[i] for i in launcher.variable_places), dt)
    return StepFunction.apply(launcher, *inputs, dt)


def _merged(launcher: Launcher, variables: Any, data: Any) -> list:
    """The inputs in table order from the others (at ``launcher.variable_places``) and the cost
    parameters (at ``launcher.parameter_places``)."""
    merged: list = [None] * (len(variables) + len(data))
    for i, x in zip(launcher.variable_places, variables):
        merged[i] = x
    for i, x in zip(launcher.parameter_places, data):
        merged[i] = x
    return merged


class FusedStepFunction(_FastApply):
    """A fused step's node in eager autograd: (the cost parameters as one tuple, the other inputs in
    table order, dt) → outputs. Weights, limits and margins are data that takes no gradient (each
    call checks that none requires grad), so they do not go through Function.apply one by one
    (what every argument costs there and in the engine, per call); they are saved for backward all
    the same, so one written in place before the backward makes it raise, as any saved tensor does.
    Everything else (a dt gradient, double backward, forward mode, transforms, torch.compile) runs
    the composite form (runtime/costs.py), never this node."""

    @staticmethod
    def forward(launcher: Launcher, data, *args):  # type: ignore[override]
        *variables, dt = args
        return tuple(launcher.forward(_merged(launcher, variables, data), dt))

    @staticmethod
    def setup_context(ctx, inputs, output):
        launcher, data, *args = inputs
        ctx.launcher = launcher
        ctx.save_for_backward(*args, *data)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        launcher: Launcher = ctx.launcher
        saved = ctx.saved_tensors
        n = len(launcher.variable_places)
        variables, dt, data = saved[:n], saved[n], saved[n + 1:]
        needs = (*_merged(launcher, ctx.needs_input_grad[2:2 + n], (False,) * len(data)), ctx.needs_input_grad[-1])
        got = _backward(launcher, _merged(launcher, variables, data), dt, grads, needs)
        return (None, None, *(got[i] for i in launcher.variable_places), got[-1])


def _recomputed(launcher: Launcher, inputs: list, dt: Tensor, grads: tuple, needed: tuple) -> list:
    """A fused step's gradients through its composite form (runtime/costs.py): with a gradient
    with respect to dt, and for double backward (create_graph), where the graph it builds is what
    the next derivative differentiates."""
    create = torch.is_grad_enabled()
    with torch.enable_grad():
        xs = [x if x is None or create else x.detach().requires_grad_(need and x.is_floating_point())
              for x, need in zip([*inputs, dt], needed)]
        outs = launcher.composite(xs[:-1], xs[-1])
        wanted = [x for x, need in zip(xs, needed) if need and x is not None]
        pairs = [(y, g) for y, g in zip(outs, grads) if g is not None]
        got = iter(torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs],
                                       create_graph=create, allow_unused=True))
    return [next(got) if need and x is not None else None for x, need in zip(xs, needed)]


class AdjointFunction(_FastApply):
    """(grads of the outputs) → per-trajectory gradients of the differentiable inputs; linear
    in the grads, so its own backward is the forward kernel."""

    @staticmethod
    def forward(launcher: Launcher, dt, B, *grads):  # type: ignore[override]
        return tuple(launcher.adjoint(grads, dt, B, (True,) * len(launcher.table.differentiable)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        launcher, dt, B = inputs[:3]
        ctx.launcher, ctx.B = launcher, B
        ctx.present = tuple(g is not None for g in inputs[3:])  # gradients only for tensors given
        ctx.save_for_backward(dt)
        ctx.save_for_forward(dt)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *ggrads):
        if ctx.needs_input_grad[1]:
            raise RuntimeError(NO_SECOND_DT)
        (dt,) = ctx.saved_tensors
        launcher: Launcher = ctx.launcher
        inputs = launcher.forward_inputs(ctx.B, ggrads)
        outs = (None,) * launcher.K if inputs is None else StepFunction.apply(launcher, *inputs, dt)
        return (None, None, None, *(y if present else None for y, present in zip(outs, ctx.present)))

    @staticmethod
    def jvp(ctx, _launcher, ddt, _dB, *dgrads):
        if ddt is not None:
            raise RuntimeError(NO_SECOND_DT)
        (dt,) = ctx.saved_tensors
        return AdjointFunction.apply(ctx.launcher, dt, ctx.B, *dgrads)  # linear in the grads

    @staticmethod
    def vmap(info, in_dims, launcher, dt, B, *grads):
        V = info.batch_size
        if launcher.per_trajectory:  # dt [B] folds with the batch
            dt = rules.fold(dt, in_dims[1], V)
        elif in_dims[1] is not None:
            return rules.by_loop(AdjointFunction.apply, info.batch_size, in_dims, (launcher, dt, B, *grads))
        flat = [rules.fold(g, d, V) for g, d in zip(grads, in_dims[3:])]
        return rules.unfold(AdjointFunction.apply(launcher, dt, V * B, *flat), V)


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
    def vmap(cls, info, in_dims, *args: Any):
        return rules.by_loop(cls.apply, info.batch_size, in_dims, args)


class DtVjpFunction(_FirstOrderOnly):
    """Gradient with respect to the kernel's dt vector: (launcher, dt, *inputs, *grads)."""

    @staticmethod
    def forward(launcher: Launcher, dt, *rest):  # type: ignore[override]
        n = len(launcher.table.tensors)
        return launcher.dt_vjp(rest[:n], rest[n:], dt)


class DtJvpFunction(_FirstOrderOnly):
    """Output tangents when dt has a tangent too, Ṁ x + M ẋ in one generated kernel:
    (launcher, dt, ddt, *inputs, *tangents of the differentiable inputs)."""

    @staticmethod
    def forward(launcher: Launcher, dt, ddt, *rest):  # type: ignore[override]
        n = len(launcher.table.tensors)
        return tuple(launcher.dt_jvp(rest[:n], rest[n:], dt, ddt))
