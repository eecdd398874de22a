"""The differentiation rules of a step, written once over its argument table.

The eager autograd Function (runtime/autograd.py), the custom ops torch.compile traces
(runtime/ops.py) and the native node's Python fallbacks all use these three rules; each
mechanism only supplies how to run a kernel (a Function's ``apply``, an op, a launcher call).

* ``backward``: the adjoint kernel gives per-trajectory gradients of the differentiable
  inputs; rows an index picks (``start_index``) are summed back onto their table; dt's
  gradient comes from the dt_vjp kernel.
* ``jvp``: the step is affine in its tensor inputs, so their tangent is the step applied to
  the tangents; with a dt tangent the dt_jvp kernel adds the coefficients' derivative.
* ``vmap``: the vmapped dimension is folded into the batch (index entries offset into the
  folded tables); a vmapped dt runs one call per element, except a per-trajectory dt [B],
  which folds with the batch.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..codegen.arguments import INDEX, ArgumentTable

Tensor = torch.Tensor
OptTensor = Optional[Tensor]


def scatter_rows(per_batch: Tensor, index: OptTensor, rows: int) -> Tensor:
    """Per-trajectory gradients [B, ...] → table rows [rows, ...] (summed where rows are shared), the
    same bits on every call: on CUDA ``index_add`` adds with atomics, in an order that changes from
    run to run, where ``index_put`` with ``accumulate`` sorts the index stably and adds a row's
    entries in batch order."""
    if index is None:
        return per_batch
    table = per_batch.new_zeros((rows, *per_batch.shape[1:]))
    if per_batch.is_cuda:
        return table.index_put((index,), per_batch, accumulate=True)
    return table.index_add(0, index, per_batch)


def backward(table: ArgumentTable, inputs: Sequence[OptTensor], grads: Sequence[OptTensor],
             needs: Sequence[bool], adjoint: Callable[[Sequence[bool]], Sequence[OptTensor]],
             dt_vjp: Callable[[], Tensor]) -> list[OptTensor]:
    """Gradients for every input in table order (dt last), given the outputs' gradients.

    ``adjoint(needed)`` returns per-trajectory gradients of ``table.differentiable`` (None where
    not needed); ``dt_vjp()`` the gradient of dt. ``needs`` flags the inputs that want one."""
    out: list[OptTensor] = [None] * len(table.inputs)
    if all(g is None for g in grads):
        return out
    places = table.gradient_places
    wanted = [needs[i] and inputs[i] is not None for i, _ in places]
    if any(wanted):
        for (i, index_at), g, want in zip(places, adjoint(wanted), wanted):
            if want:
                index = inputs[index_at] if index_at is not None else None
                out[i] = scatter_rows(g, index, inputs[i].shape[0])
    if needs[-1]:
        out[-1] = dt_vjp()
    return out


def jvp(table: ArgumentTable, inputs: Sequence[OptTensor], tangents: Sequence[OptTensor], dt: Tensor,
        dt_tangent: OptTensor, step: Callable[..., Any], dt_jvp: Callable[..., Any]) -> Any:
    """Output tangents. ``step(*inputs, dt)`` runs the forward, ``dt_jvp(tangents, ddt)`` the
    kernel that also differentiates the coefficients."""
    if dt_tangent is not None:
        return dt_jvp([t for a, t in zip(table.tensors, tangents) if a.differentiable], dt_tangent)
    applied = []
    for arg, x, t in zip(table.tensors, inputs, tangents):
        if arg.dtype == INDEX or x is None:
            applied.append(x)  # the index selects; an absent optional input stays absent
        else:
            applied.append(torch.zeros_like(x) if t is None else t)
    return step(*applied, dt)


def _fold(t: Tensor, dim: Optional[int], V: int) -> Tensor:
    """Move the vmapped dim to the front (expanding an unbatched tensor) and merge it with the next."""
    t = t.movedim(dim, 0) if dim is not None else t.unsqueeze(0).expand(V, *t.shape)
    return t.reshape(V * t.shape[1], *t.shape[2:]).contiguous()


def fold(t: OptTensor, dim: Optional[int], V: int) -> OptTensor:
    return None if t is None else _fold(t, dim, V)


def unfold(outputs: Sequence[Tensor], V: int) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
    """Outputs of a folded call back to [V, B, ...], vmapped on dim 0."""
    B = outputs[0].shape[0] // V
    return tuple(o.reshape(V, B, *o.shape[1:]) for o in outputs), (0,) * len(outputs)


def by_loop(apply: Callable[..., Any], V: int, in_dims: Sequence[Optional[int]], args: Sequence[Any]):
    """The generic vmap rule: one call per vmapped element, outputs stacked on dim 0."""
    results = []
    for v in range(V):
        sliced = [a.select(d, v) if (d is not None and isinstance(a, Tensor)) else a for a, d in zip(args, in_dims)]
        results.append(apply(*sliced))
    if isinstance(results[0], Tensor):
        return torch.stack(results), 0
    stacked = tuple(torch.stack(parts) for parts in zip(*results))
    return stacked, (0,) * len(stacked)


def _rows(t: Tensor, dim: Optional[int]) -> int:
    """Rows of a table per vmapped element (its first dimension other than the vmapped one)."""
    shape = list(t.shape)
    if dim is not None:
        del shape[dim]
    return shape[0]


def vmap(table: ArgumentTable, V: int, in_dims: Sequence[Optional[int]], inputs: Sequence[OptTensor],
         dt: Tensor, apply: Callable[..., Any]):
    """vmap of ``apply(*inputs, dt)`` (inputs in table order), folding V into the batch.

    An indexed table keeps its rows when they are not vmapped (every element picks from the
    same rows); when they are, the folded table has V·S rows and element v's entries move by v·S.
    """
    *input_dims, dt_dim = in_dims
    if table.dt.shape == ("B",):  # one dt per trajectory: it folds with the batch, vmapped or not
        dt = _fold(dt, dt_dim, V)
    elif dt_dim is not None:
        return by_loop(apply, V, in_dims, (*inputs, dt))
    position = {a.name: i for i, a in enumerate(table.tensors)}
    folded: list[OptTensor] = []
    for arg, x, d in zip(table.tensors, inputs, input_dims):
        if x is None or arg.dtype == INDEX:
            folded.append(x)
        elif arg.index and all(input_dims[position[a.name]] is None
                               for a in table.tensors if a.index == arg.index):
            folded.append(x)  # shared rows, picked by the (folded) index
        else:
            folded.append(_fold(x, d, V))
    for i, (arg, x, d) in enumerate(zip(table.tensors, inputs, input_dims)):
        if arg.dtype != INDEX or x is None:
            continue
        picked = [a for a in table.tensors if a.index == arg.name]
        entries = x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(V, *x.shape)
        if any(input_dims[position[a.name]] is not None for a in picked):
            S = _rows(inputs[position[picked[0].name]], input_dims[position[picked[0].name]])
            entries = entries + torch.arange(V, device=x.device, dtype=x.dtype).unsqueeze(1) * S
        folded[i] = entries.reshape(-1).contiguous()  # with B=1 the reshape is a stride-0 view
    return unfold(apply(*folded, dt), V)
