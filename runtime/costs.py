"""Cost terms of a fused step (a spec with ``costs`` or a subset of ``outputs``), on the runtime side.

The generated kernels compute the requested states and the cost in one forward and take the
cost's gradient to the inputs in one backward (codegen/fused.py). Everything else — a gradient
with respect to dt, double backward, forward mode, functorch transforms, torch.compile — runs
the same definitions composed from the plain step (every state) and PyTorch operations on it
(``composite``), with each kind's expression from codegen/costs.py. The two agree to rounding
(tests compare them).

Parameter checks: weights, limits and margins are data, not variables (none of them takes a
gradient), and their values are checked before any kernel runs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from ..codegen.arguments import ArgumentTable
from . import validate

Tensor = torch.Tensor
STATES = ("position", "velocity", "acceleration", "jerk", "snap")


@functools.lru_cache(maxsize=None)
def pointwise(kind: str) -> Callable[..., Tensor]:
    """A kind's expression as a PyTorch function of (y, w, lower, upper, margin, target) (SymPy's
    lambdify of codegen/costs.py's expression; imported when first needed)."""
    import sympy as sp

    from ..codegen import costs as kinds

    args = (kinds.Y, kinds.W, kinds.LOWER, kinds.UPPER, kinds.MARGIN, kinds.TARGET)
    return sp.lambdify(args, kinds.KINDS[kind].expression,
                       modules=[{"Max": lambda a, b: torch.maximum(torch.as_tensor(a, dtype=b.dtype), b)}])


def _bhd(y: Tensor, layout: str) -> Tensor:
    return y if layout == "bhd" else y.transpose(1, 2)


def functions(table: ArgumentTable) -> dict[str, Callable[..., Tensor]]:
    """The PyTorch function of each kind a table's terms use (made before any tracing: torch.compile
    traces the functions, not SymPy's making of them)."""
    return {kind: pointwise(kind) for kind, _ in table.costs}


def term_values(table: ArgumentTable, states: Sequence[Tensor], named: dict[str, Optional[Tensor]],
                kinds: Optional[dict[str, Callable[..., Tensor]]] = None) -> Tensor:
    """The cost output [B, T] from every state (P, V, A, J[, S], in the table's layout) and the
    keyword parameters by name (``kinds``: ``functions(table)``, made here when not given)."""
    kinds = functions(table) if kinds is None else kinds
    out = []
    for kind, state in table.costs:
        k = STATES.index(state)
        y = _bhd(states[k], table.layout)
        B, H, D = y.shape
        p = lambda suffix: named.get(f"{kind}_{state}_{suffix}")
        weight = p("weight")
        row = p("row_weight")
        w = weight.reshape(-1, 1, D) * (row.reshape(1, H, 1) if row is not None else 1.0)
        zero = y.new_zeros(1, 1, D)
        lower = upper = margin = target = zero
        if kind == "bound":
            limit = p("limit")
            lower, upper = limit[0].reshape(1, 1, D), limit[1].reshape(1, 1, D)
            margin = p("margin").reshape(1, 1, D) if p("margin") is not None else zero
        if (kind, state) == ("squared", "position") and named.get("squared_position_target") is not None:
            target = _picked(named["squared_position_target"], named.get("goal_index")).reshape(B, 1, D)
        out.append(kinds[kind](y, w, lower, upper, margin, target).sum(dim=(1, 2)))
    return torch.stack(out, dim=1)


def _picked(rows: Tensor, index: Optional[Tensor]) -> Tensor:
    return rows if index is None else rows[index.reshape(-1).long()]


def check_parameters(table: ArgumentTable, named: dict[str, Optional[Tensor]], seen: Optional[dict] = None) -> None:
    """The checks on a fused step's cost parameters that the argument table cannot express:
    none takes a gradient, weights and margins are not negative, limits are finite with
    lower <= upper. ``seen``: each argument's last tensor that passed (its storage, version and
    shape), not looked at again while unchanged (an optimiser passes the same weights every call).
    The tensor is kept with its stamp: while kept, its address cannot be another tensor's."""
    for arg in table.tensors:
        t = named.get(arg.name)
        if t is None or not validate.cost_parameter(arg):
            continue
        now = validate.stamp(t) if seen is not None else None
        if now is not None and validate.unchanged(seen.get(arg.name), t, now):
            continue
        if t.requires_grad:
            raise ValueError(f"{arg.name}: cost parameters take no gradient (weights, limits and margins are "
                             "data); pass a tensor that does not require grad (.detach())")
        if torch.compiler.is_compiling():  # values are data-dependent: checked by eager calls only
            continue
        if arg.role in ("cost_weight", "cost_row_weight", "cost_margin") and bool((t < 0).any()):
            raise ValueError(f"{arg.name}: expected values >= 0, got a minimum of {float(t.min())}")
        if arg.role == "cost_limit":
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{arg.name}: expected finite limits, got {t.tolist()}")
            if bool((t[0] > t[1]).any()):
                d = int((t[0] > t[1]).nonzero()[0, 0])
                raise ValueError(f"{arg.name}: lower > upper at dof {d} ({float(t[0, d])} > {float(t[1, d])})")
        if now is not None:
            seen[arg.name] = (t, now)


def composite(plain: Any, table: ArgumentTable, inputs: Sequence[Optional[Tensor]], dt: Tensor,
              kinds: Optional[dict[str, Callable[..., Tensor]]] = None) -> tuple[Tensor, ...]:
    """The fused step's outputs composed from the plain step and PyTorch operations: the written
    states, then the cost [B, T] (every operation differentiable, to any order)."""
    named = {a.name: x for a, x in zip(table.tensors, inputs)}
    goal = tuple(named[a.name] for a in plain.table.tensors if a.role == "goal") or None
    states = plain(named["u"], named["p0"], named["v0"], named["a0"], dt, j0=named["j0"],
                   start_index=named.get("start_index"),
                   **({"goal": goal, "goal_index": named.get("goal_index")} if goal else {}))
    written = [y for y, a in zip(states, plain.table.outputs) if any(o.name == a.name for o in table.outputs)]
    return (*written, term_values(table, states, named, kinds)) if table.costs else tuple(written)
