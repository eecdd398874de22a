"""torch.library ops: how torch.compile sees a step (no graph breaks).

For each kernel family three ops are defined, their schemas written from the family's
argument table: ``tensorstep::<family>`` (forward: a kernel key, then the inputs in table
order), ``tensorstep::<family>_adjoint`` (with an overload ``.needed`` that returns only the
gradients a backward asks for) and ``tensorstep::<family>_dt_vjp``. Each has a fake kernel
whose shapes come from the table; autograd and vmap use the shared rules (runtime/rules.py),
the same ones as the eager Function (an unused output's gradient stays None: no zeros are
filled). Value checks that need the data (index range, dt) run inside the op implementations.

A compiled graph calls these ops on every call, so they are defined with ``torch.library``'s
low-level ``Library`` and a lean autograd kernel of our own rather than with ``custom_op``, whose
per-call wrappers (Python hops, output checks) cost several times a small kernel. On CPU, once
the native node (runtime/native.py) is built and a kernel key's first call has bound the key to
its handle (``_kernel``), the forward and adjoint ops run in the node: it registers C++ CPU and
autograd kernels for them, so a compiled graph's call never enters Python. The Python kernels
here serve the rest: other devices, no node, the first call of a key, a call that wants a
gradient (the autograd.Functions below) and values whose error the Python checks explain.

Registering costs milliseconds, so ``Step`` does it only when torch.compile first traces a step
(``api._custom_ops``).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from . import native, rules, validate
from .autograd import NO_SECOND_DT
from .launch import CpuBackend
from .registry import launcher as _launcher

_below_autograd = torch._C._AutoDispatchBelowAutograd
_any_requires_grad = torch._C._any_requires_grad


@dataclasses.dataclass(frozen=True)
class FamilyOps:
    """The ops of one kernel family (the overloads a graph calls)."""

    step: Any
    adjoint: Any
    #: the adjoint returning only the gradients a backward needs (no kernel work, no allocation for
    #: the others): (str key, int batch, Tensor?[] grads, Tensor dt, bool[] needed) -> Tensor[]
    adjoint_needed: Any
    dt_vjp: Any


def _check_values(launcher: Any, inputs: list, dt: Tensor) -> None:
    """The data-dependent checks, on real tensors (they are skipped while tracing)."""
    if dt.device.type == "cpu":
        validate.check_indices(launcher.table, inputs)
        validate.check_dt_values(dt)


_FAMILIES: dict[str, FamilyOps] = {}
_LIBRARY: Optional[torch.library.Library] = None
#: kernel key → (the launcher, held weakly: its step holds it; native handle or None, settled, positions
#: of the table's required inputs)
_KERNELS: dict[str, tuple[Any, Optional[int], bool, tuple[int, ...]]] = {}


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


def _kernel(key: str) -> tuple[Any, Optional[int], tuple[int, ...]]:
    """A key's launcher, the native node's handle for a CPU kernel (None while it builds, asked
    again on the next call, or when there is no node), and the positions of required inputs."""
    found = _KERNELS.get(key)
    launcher = found[0]() if found is not None else None
    if launcher is None or not found[2]:
        from ..codegen.arguments import REQUIRED

        launcher = _launcher(key)
        required = tuple(i for i, a in enumerate(launcher.table.inputs) if a.presence == REQUIRED)
        if isinstance(launcher.backend, CpuBackend) and not launcher.table.fused:  # (compiled fused calls: composite)
            settled = native.ready()  # asked first: a build that ends in between is taken next time
            handle = native.handle(launcher)
            if handle is not None:  # the key's later calls run in the node, without Python
                _serve_node()
                native.bind(key, handle, launcher.table.family)
            found = (weakref.ref(launcher), handle, settled or handle is not None, required)
        else:
            found = (weakref.ref(launcher), None, True, required)
        _KERNELS[key] = found
    return launcher, found[1], found[3]


_NODE_IMPL: Optional[torch.library.Library] = None


def _serve_node() -> None:
    """Register (once, before the node's first key is bound) the Python implementations that the
    native node's CPU kernels for these ops call for what they leave to Python."""
    global _NODE_IMPL
    if _NODE_IMPL is not None:
        return

    def forward_py(key: str, inputs: list) -> list[Tensor]:
        return forward(key, tuple(inputs))

    lib = torch.library.Library("tensorstep_native", "IMPL")  # kept alive: it holds the registration
    lib.impl("forward_py", forward_py, "CompositeImplicitAutograd")
    lib.impl("adjoint_py", adjoint, "CompositeImplicitAutograd")
    lib.impl("forward_autograd_py", forward_autograd, "CompositeImplicitAutograd")
    lib.impl("adjoint_autograd_py", adjoint_autograd, "CompositeImplicitAutograd")
    _NODE_IMPL = lib


def forward(key: str, args: tuple) -> list[Tensor]:
    """The forward on real tensors: the native op (its checks in C++), else the Python checks and
    launcher. A value the native op refuses is explained by the Python checks; a call without a
    required input (the double backward's forward on gradients, which has no index) takes the
    launcher, as the native op would refuse it."""
    launcher, handle, required = _kernel(key)
    if (handle is not None and all(args[i] is not None for i in required)
            and not (torch.is_grad_enabled() and _any_requires_grad(*args))):
        outs = torch.ops.tensorstep_native.step.default(handle, list(args))
        if outs:
            return outs
    *inputs, dt = args
    _check_values(launcher, inputs, dt)
    return launcher.forward(inputs, dt)


def adjoint(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor,
            needed: Optional[list[bool]] = None) -> list[Tensor]:
    """The adjoint on real tensors: the gradients of the differentiable inputs (those ``needed``)."""
    launcher, _, _ = _kernel(key)
    shapes = launcher.adjoint_shapes(batch)
    flags = _flags(shapes, needed)
    if all(g is None for g in grads):
        return [dt.new_zeros(shape) for shape, n in zip(shapes, flags) if n]
    return [g for g, n in zip(launcher.adjoint(grads, dt, batch, flags), flags) if n]


def _flags(shapes: Sequence[Any], needed: Optional[Sequence[bool]]) -> Sequence[bool]:
    """Which of the adjoint's gradients a call returns: those ``needed`` (None: all of them)."""
    return (True,) * len(shapes) if needed is None else needed


def forward_autograd(key: str, inputs: list[Optional[Tensor]]) -> list[Tensor]:
    """The forward with its autograd node (a call that wants a gradient)."""
    return list(_StepNode.apply(ops_for(_launcher(key)), key, *inputs))


def adjoint_autograd(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor,
                     needed: Optional[list[bool]]) -> list[Tensor]:
    """The adjoint (all gradients, or those ``needed``) with its autograd node."""
    ops = ops_for(_launcher(key))
    op = ops.adjoint if needed is None else ops.adjoint_needed
    return list(_AdjointNode.apply(op, key, batch, dt, needed, *grads))


class _StepNode(torch.autograd.Function):
    """The autograd node of a forward op; its backward runs the adjoint and dt_vjp ops (so that a
    compiled backward graph holds them)."""

    @staticmethod
    def forward(ctx, ops: FamilyOps, key: str, *args: Optional[Tensor]):  # type: ignore[override]
        with _below_autograd():
            outs = ops.step(key, *args)
        ctx.ops, ctx.key = ops, key
        ctx.save_for_backward(*args)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to fill
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        ops: FamilyOps = ctx.ops
        *xs, dt = ctx.saved_tensors
        key, B = ctx.key, xs[0].shape[0]
        listed = list(grads)
        out = rules.backward(_launcher(key).table, xs, listed, ctx.needs_input_grad[2:],
                             lambda needed: _placed(ops.adjoint_needed(key, B, listed, dt, list(needed)), needed),
                             lambda: ops.dt_vjp(key, *xs, dt, listed))
        return (None, None, *out)


def _placed(returned: Sequence[Optional[Tensor]], needed: Any) -> list[Optional[Tensor]]:
    """The gradients of ``adjoint_needed`` on their places among the differentiable inputs."""
    it = iter(returned)
    return [next(it) if n else None for n in needed]


class _AdjointNode(torch.autograd.Function):
    """An adjoint op's node: linear in the grads, so its backward is the forward op.
    ``needed``: the differentiable inputs whose gradients the op returns (None: all)."""

    @staticmethod
    def forward(ctx, op: Any, key: str, batch: int, dt: Tensor, needed: Optional[list[bool]],  # type: ignore[override]
                *grads: Optional[Tensor]):
        with _below_autograd():
            outs = op(key, batch, list(grads), dt) if needed is None else op(key, batch, list(grads), dt, needed)
        ctx.key, ctx.batch, ctx.needed = key, batch, needed
        ctx.present = [g is not None for g in grads]
        ctx.save_for_backward(dt)
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *out_grads: Optional[Tensor]):
        if ctx.needs_input_grad[3]:
            raise RuntimeError(NO_SECOND_DT)
        (dt,) = ctx.saved_tensors
        launcher = _launcher(ctx.key)
        none = (None,) * 5
        # the returned gradients back onto their inputs' places
        grads = out_grads if ctx.needed is None else _placed(out_grads, ctx.needed)
        inputs = launcher.forward_inputs(ctx.batch, grads)
        if inputs is None:
            return (*none, *(None for _ in ctx.present))
        outs = ops_for(launcher).step(ctx.key, *inputs, dt)
        return (*none, *(y if present else None for y, present in zip(outs, ctx.present)))


class _DtVjpNode(torch.autograd.Function):
    """dt's gradient: first order only (differentiating it again raises, never a silent zero)."""

    @staticmethod
    def forward(ctx, op: Any, key: str, n: int, *args: Optional[Tensor]):  # type: ignore[override]
        with _below_autograd():  # args: the inputs and dt, then the grads (unpacked: autograd sees them)
            return op(key, *args[:n], list(args[n:]))

    @staticmethod
    def backward(ctx, *_: Any):
        raise RuntimeError(NO_SECOND_DT)


def _register(family: str, table: Any) -> FamilyOps:
    """Define the ops of a family; ``table`` is any of its tables (they share the schema)."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("tensorstep", "FRAGMENT")  # kept: it holds the registrations
    lib = _LIBRARY
    n = len(table.tensors)
    name = f"tensorstep::{family}"
    tags = (torch.Tag.pt2_compliant_tag,)
    lib.define(family + table.schema(), tags=tags)
    lib.define(f"{family}_adjoint(str key, int batch, Tensor?[] grads, Tensor dt) -> Tensor[]", tags=tags)
    lib.define(f"{family}_adjoint.needed(str key, int batch, Tensor?[] grads, Tensor dt, bool[] needed) -> Tensor[]",
               tags=tags)
    lib.define(f"{family}_dt_vjp" + table.schema("Tensor?[] grads", returns="Tensor"), tags=tags)
    namespace = torch.ops.tensorstep
    adjoint_packet = getattr(namespace, f"{family}_adjoint")
    ops = FamilyOps(getattr(namespace, family).default, adjoint_packet.default, adjoint_packet.needed,
                    getattr(namespace, f"{family}_dt_vjp").default)
    step, dt_vjp = ops.step, ops.dt_vjp

    # ---- the kernels (any device), and their fakes (shapes from the table) ---------------------------

    def step_impl(key: str, *args: Optional[Tensor]) -> list[Tensor]:
        return forward(key, args)

    def step_fake(key: str, *args: Optional[Tensor]) -> list[Tensor]:
        launcher = _launcher(key)
        u = args[0]
        return [u.new_empty(shape) for shape in launcher.output_shapes(u.shape[0])]

    def adjoint_fake(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor,
                     needed: Optional[list[bool]] = None) -> list[Tensor]:
        shapes = _launcher(key).adjoint_shapes(batch)
        return [dt.new_empty(shape) for shape, n in zip(shapes, _flags(shapes, needed)) if n]

    def dt_vjp_impl(key: str, *args: Any) -> Tensor:
        *inputs, dt, grads = args
        return _launcher(key).dt_vjp(inputs, grads, dt).to(dt.dtype)

    def dt_vjp_fake(key: str, *args: Any) -> Tensor:
        dt = args[n]
        return dt.new_empty(dt.shape)

    for op_name, impl, fake in ((family, step_impl, step_fake), (f"{family}_adjoint", adjoint, adjoint_fake),
                                (f"{family}_adjoint.needed", adjoint, adjoint_fake),
                                (f"{family}_dt_vjp", dt_vjp_impl, dt_vjp_fake)):
        lib.impl(op_name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"tensorstep::{op_name}", fake, lib=lib)

    # ---- autograd: a node only when a gradient is wanted; else straight to the kernel --------------

    def step_autograd(key: str, *args: Optional[Tensor]) -> list[Tensor]:
        if torch.is_grad_enabled() and _any_requires_grad(*args):
            return list(_StepNode.apply(ops, key, *args))
        with _below_autograd():
            return step(key, *args)

    def adjoint_autograd(op: Any) -> Any:
        def kernel(key: str, batch: int, grads: list[Optional[Tensor]], dt: Tensor, *needed: list[bool]) -> list[Tensor]:
            if torch.is_grad_enabled() and _any_requires_grad(dt, *grads):
                return list(_AdjointNode.apply(op, key, batch, dt, needed[0] if needed else None, *grads))
            with _below_autograd():
                return op(key, batch, grads, dt, *needed)

        return kernel

    def dt_vjp_autograd(key: str, *args: Any) -> Tensor:
        if torch.is_grad_enabled() and _any_requires_grad(*args[:-1], *args[-1]):
            return _DtVjpNode.apply(dt_vjp, key, n + 1, *args[:-1], *args[-1])
        with _below_autograd():
            return dt_vjp(key, *args)

    lib.impl(family, step_autograd, "Autograd")
    lib.impl(f"{family}_adjoint", adjoint_autograd(ops.adjoint), "Autograd")
    lib.impl(f"{family}_adjoint.needed", adjoint_autograd(ops.adjoint_needed), "Autograd")
    lib.impl(f"{family}_dt_vjp", dt_vjp_autograd, "Autograd")

    # ---- vmap: the shared rule ---------------------------------------------------------------------

    def step_vmap(info, in_dims, key, *args):
        outs, dims = rules.vmap(_launcher(key).table, info.batch_size, in_dims[1:], args[:-1], args[-1],
                                lambda *a: step(key, *a))
        return list(outs), list(dims)

    torch.library.register_vmap(name, step_vmap, lib=lib)
    return ops
