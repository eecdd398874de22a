"""torch.library custom ops: how torch.compile sees a step (no graph breaks).

For each kernel family three ops are registered, their schemas written from the family's
argument table: ``tensorstep::<family>`` (forward: a kernel key, then the inputs in table
order), ``tensorstep::<family>_adjoint`` and ``tensorstep::<family>_dt_vjp``. Each has a fake
kernel whose shapes come from the table; autograd and vmap use the shared rules
(runtime/rules.py), the same ones as the eager Function. Value checks that need the data
(index range, dt) run inside the op implementations.

Registering costs milliseconds (``torch.library.custom_op``), so ``Step`` does it only when
torch.compile first traces a step (``api._custom_ops``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from . import rules, validate
from .autograd import NO_SECOND_DT
from .registry import launcher as _launcher


@dataclasses.dataclass(frozen=True)
class FamilyOps:
    """The three ops of one kernel family."""

    step: Any
    adjoint: Any
    dt_vjp: Any


def _check_values(launcher: Any, inputs: list, dt: Tensor) -> None:
    """The data-dependent checks, on real tensors (they are skipped while tracing)."""
    if dt.device.type == "cpu":
        validate.check_indices(launcher.table, inputs)
        validate.check_dt_values(dt)


_FAMILIES: dict[str, FamilyOps] = {}


def ops_for(launcher: Any) -> FamilyOps:
    """The ops serving a launcher's kernel family (registered on first use)."""
    return _family_ops(launcher.table)


def register_all() -> None:
    """Register the ops of every kernel family now (each spec of a family shares its schema)."""
    from ..codegen.arguments import table
    from ..codegen.spec import KernelSpec

    for spec in (KernelSpec(horizon=3, dof=1), KernelSpec(horizon=3, dof=1, end="goal")):
        _family_ops(table(spec))


def _family_ops(table: Any) -> FamilyOps:
    if table.family not in _FAMILIES:
        _FAMILIES[table.family] = _register(table.family, table)
    return _FAMILIES[table.family]


def _register(family: str, table: Any) -> FamilyOps:
    """Register the ops of a family; ``table`` is any of its tables (they share the schema)."""
    n = len(table.tensors)
    name = f"tensorstep::{family}"

    def step_impl(key: str, *args: Optional[Tensor]) -> list[Tensor]:
        launcher = _launcher(key)
        *inputs, dt = args
        _check_values(launcher, inputs, dt)
        return launcher.forward(inputs, dt)

    def step_fake(key: str, *args: Optional[Tensor]) -> list[Tensor]:
        launcher = _launcher(key)
        u = args[0]
        return [u.new_empty(launcher.output_shape(u.shape[0])) for _ in range(launcher.K)]

    step = torch.library.custom_op(name, step_impl, mutates_args=(), schema=table.schema())
    step.register_fake(step_fake)

    def adjoint_impl(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor) -> list[Tensor]:
        launcher = _launcher(key)
        if all(g is None for g in grads):
            return [dt.new_zeros(launcher.per_batch_shape(a, batch)) for a in launcher.table.differentiable]
        return list(launcher.adjoint(grads, dt, batch, (True,) * len(launcher.table.differentiable)))

    def adjoint_fake(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor) -> list[Tensor]:
        launcher = _launcher(key)
        return [dt.new_empty(launcher.per_batch_shape(a, batch)) for a in launcher.table.differentiable]

    adjoint = torch.library.custom_op(f"{name}_adjoint", adjoint_impl, mutates_args=(),
                                      schema="(str key, int batch, Tensor?[] grads, Tensor dt) -> Tensor[]")
    adjoint.register_fake(adjoint_fake)

    def dt_vjp_impl(key: str, *args: Any) -> Tensor:
        *inputs, dt, grads = args
        return _launcher(key).dt_vjp(inputs, grads, dt).to(dt.dtype)

    def dt_vjp_fake(key: str, *args: Any) -> Tensor:
        dt = args[n]
        return dt.new_empty(dt.shape)

    dt_vjp = torch.library.custom_op(f"{name}_dt_vjp", dt_vjp_impl, mutates_args=(),
                                     schema=table.schema("Tensor?[] grads", returns="Tensor"))
    dt_vjp.register_fake(dt_vjp_fake)

    # ---- autograd: the shared backward rule over these ops ----------------------------------------

    def step_setup(ctx, inputs, output):
        ctx.key = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    def step_backward(ctx, grads):
        *xs, dt = ctx.saved_tensors
        grads = list(grads)
        B = xs[0].shape[0]
        launcher = _launcher(ctx.key)
        out = rules.backward(launcher.table, xs, grads, ctx.needs_input_grad[1:],
                             lambda needed: adjoint(ctx.key, B, grads, dt),
                             lambda: dt_vjp(ctx.key, *xs, dt, grads))
        return (None, *out)

    step.register_autograd(step_backward, setup_context=step_setup)

    def adjoint_setup(ctx, inputs, output):
        key, batch, grads, dt = inputs
        ctx.key, ctx.batch = key, batch
        ctx.present = [g is not None for g in grads]
        ctx.save_for_backward(dt)

    def adjoint_backward(ctx, out_grads):
        if ctx.needs_input_grad[3]:
            raise RuntimeError(NO_SECOND_DT)
        (dt,) = ctx.saved_tensors
        inputs = _launcher(ctx.key).forward_inputs(ctx.batch, out_grads)
        if inputs is None:
            return None, None, None, None
        outs = step(ctx.key, *inputs, dt)
        return None, None, [y if present else None for y, present in zip(outs, ctx.present)], None

    adjoint.register_autograd(adjoint_backward, setup_context=adjoint_setup)

    # ---- vmap: the shared rule ---------------------------------------------------------------------

    def step_vmap(info, in_dims, key, *args):
        outs, dims = rules.vmap(_launcher(key).table, info.batch_size, in_dims[1:], args[:-1], args[-1],
                                lambda *a: step(key, *a))
        return list(outs), list(dims)

    torch.library.register_vmap(name, step_vmap)
    return FamilyOps(step, adjoint, dt_vjp)

