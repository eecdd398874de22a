"""Cost terms of a fused step (a spec with ``costs`` or a subset of ``outputs``), on the runtime side.

The generated kernels compute the requested states and the cost in one forward and take the
cost's gradient to the inputs in one backward (codegen/fused.py). Everything else — a gradient
with respect to dt, double backward, forward mode, functorch transforms, torch.compile — runs
the same definitions composed from the plain step (every state) and PyTorch operations on it
(``composite``), with each kind's expression from codegen/costs.py. The two agree to rounding
(tests compare them).

Parameter checks: weights, limits and margins are data, not variables (none of them takes a
gradient), and their values are checked before any kernel runs (``CheckedParameters``: once
per tensor while it is passed unchanged).
"""
from __future__ import annotations

import builtins
import functools
import inspect
from typing import Any, Callable, Optional, Sequence

import torch

from ..codegen.arguments import Argument, ArgumentTable, message, unknown_keyword
from . import validate
from .cache import BuildCache, building
from .fingerprint import generator_fingerprint

Tensor = torch.Tensor
STATES = ("position", "velocity", "acceleration", "jerk", "snap")


#: what the kinds' PyTorch functions call besides Python's operators (their namespace, as lambdify's)
NAMESPACE = {"Max": lambda a, b: torch.maximum(torch.as_tensor(a, dtype=b.dtype), b), "builtins": builtins}


def _lambdified() -> dict[str, str]:
    """Each cost kind's PyTorch function of (y, w, lower, upper, margin, target), as Python source:
    SymPy's lambdify of codegen/costs.py's expression (SymPy imported here, where nothing is kept)."""
    import sympy as sp

    from ..codegen import costs as kinds

    args = (kinds.Y, kinds.W, kinds.LOWER, kinds.UPPER, kinds.MARGIN, kinds.TARGET)
    return {name: inspect.getsource(sp.lambdify(args, kind.expression, modules=[NAMESPACE]))
            for name, kind in kinds.KINDS.items()}


#: the cost kinds' making with SymPy (``_lambdified``) as the build notice names it (``cache.building``)
KINDS_BUILD = ("the cost kinds", "their PyTorch functions, with SymPy")


def _made() -> dict[str, str]:
    """``_lambdified``, counted as a build of the user's wait (SymPy's import included)."""
    with building(*KINDS_BUILD):
        return _lambdified()


@functools.lru_cache(maxsize=1)
def sources() -> dict[str, str]:
    """Every cost kind's function source (``_lambdified``), kept in the kernel cache by the generator's
    fingerprint as the kernels are: a process whose kernels and kinds are cached imports no SymPy."""
    valid = lambda found: all(isinstance(v, str) and v.startswith("def ") for v in found.values()) and bool(found)
    return BuildCache().kept(f"cost-kinds-{generator_fingerprint()}", _made, valid)


@functools.lru_cache(maxsize=None)
def pointwise(kind: str) -> Callable[..., Tensor]:
    """A kind's expression as a PyTorch function of (y, w, lower, upper, margin, target): its source
    (``sources``) run in ``NAMESPACE``."""
    namespace = dict(NAMESPACE)
    exec(compile(sources()[kind], f"<tensorstep cost kind {kind}>", "exec"), namespace)
    (name,) = set(namespace) - set(NAMESPACE) - {"__builtins__"}
    return namespace[name]


def _bhd(y: Tensor, layout: str) -> Tensor:
    return y if layout == "bhd" else y.transpose(1, 2)


def functions(table: ArgumentTable) -> dict[str, Callable[..., Tensor]]:
    """The PyTorch function of each kind a table's terms use (made before any tracing: torch.compile
    traces the functions, not SymPy's making of them)."""
    return {kind: pointwise(kind) for kind, _ in table.costs}


def every_kind() -> dict[str, Callable[..., Tensor]]:
    """The PyTorch function of every cost kind (codegen/costs.py ``KINDS``; what a fused step's twin
    holds for its composite form, made where the twin is loaded: outside torch.compile's graph)."""
    return {kind: pointwise(kind) for kind in sources()}


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
        prefix = f"{kind}_{state}_"  # the term's keywords (codegen/arguments.py ``term_keywords``)
        weight, row, limit, margin, target = (named.get(prefix + p)
                                              for p in ("weight", "row_weight", "limit", "margin", "target"))
        w = weight.reshape(-1, 1, D) * (row.reshape(1, H, 1) if row is not None else 1.0)
        zero = y.new_zeros(1, 1, D)
        lower, upper = (limit[0].reshape(1, 1, D), limit[1].reshape(1, 1, D)) if limit is not None else (zero, zero)
        margin = margin.reshape(1, 1, D) if margin is not None else zero
        target = _picked(target, named.get("goal_index")).reshape(B, 1, D) if target is not None else zero
        out.append(kinds[kind](y, w, lower, upper, margin, target).sum(dim=(1, 2)))
    return torch.stack(out, dim=1)


def _picked(rows: Tensor, index: Optional[Tensor]) -> Tensor:
    return rows if index is None else rows[index.reshape(-1).long()]


def check_parameter(arg: Argument, t: Tensor) -> None:
    """The checks on a fused step's cost parameter that the argument table cannot express: it
    takes no gradient, weights and margins are finite and not negative, limits are finite with lower <= upper."""
    if t.requires_grad:
        raise ValueError(f"{arg.name}: cost parameters take no gradient (weights, limits and margins are "
                         "data); pass a tensor that does not require grad (.detach())")
    if torch.compiler.is_compiling():  # values are data-dependent: checked by eager calls only
        return
    if arg.role in ("cost_weight", "cost_row_weight", "cost_margin"):
        if not bool(torch.isfinite(t).all()):  # a NaN is not < 0, and an infinite weight times 0 is NaN
            bad = t[~torch.isfinite(t)].reshape(-1)[0]
            raise ValueError(f"{arg.name}: expected finite values >= 0, got {float(bad)}")
        if bool((t < 0).any()):
            raise ValueError(f"{arg.name}: expected values >= 0, got a minimum of {float(t.min())}")
    if arg.role == "cost_limit":
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{arg.name}: expected finite limits, got {t.tolist()}")
        if bool((t[0] > t[1]).any()):
            d = int((t[0] > t[1]).nonzero()[0, 0])
            raise ValueError(f"{arg.name}: lower > upper at dof {d} ({float(t[0, d])} > {float(t[1, d])})")


def check_parameters(table: ArgumentTable, inputs: Sequence[Optional[Tensor]]) -> None:
    """``check_parameter`` on each cost parameter of a call's checked inputs (in table order)."""
    for arg, t in zip(table.tensors, inputs):
        if t is not None and validate.cost_parameter(arg):
            check_parameter(arg, t)


class CheckedParameters:
    """A fused step's cost parameters (weights, limits, margins) as they last passed every check,
    with what the kernels read for them: a [D] weight's [B, D] rows, a default tensor for a missing
    row weight or margin.

    ``take`` stamps each given parameter once (``validate.stamp``) and compares them with the kept
    ones in one pass: a call that passes the same tensors unchanged (an optimiser's loop) takes the
    kept inputs as they are, and only the other arguments are checked. A parameter that is new or
    changed (written in place, new data or strides, requires_grad, an inference tensor, another
    batch size) is checked again by the argument checks and then by ``keep``, with the same errors,
    before any kernel runs. The given tensors are kept with their stamps: while kept, their
    addresses (each stamp's identity) cannot be another tensor's."""

    def __init__(self, table: ArgumentTable, dtype: torch.dtype, device: torch.device):
        self.table = table
        self.dtype, self.device = dtype, device
        #: the cost parameters' places in the table, and every other argument's
        self.positions = tuple(i for i, a in enumerate(table.tensors) if validate.cost_parameter(a))
        self.others = tuple(i for i in range(len(table.tensors)) if i not in self.positions)
        self._defaults: dict[str, Tensor] = {}
        #: (stamps, given tensors, kernel inputs) at ``positions`` of the last call that passed every check
        self._kept: Optional[tuple] = None

    def argument(self, arg: Argument, x: Any, u: Any) -> Any:
        """What the kernels read for a parameter given as ``x``: a [D] weight applies to every
        trajectory (given as its [B, D] rows); a missing row weight or margin as its default
        (ones, zeros: the kernels read it untested)."""
        if x is None and arg.filled:
            x = self._defaults.get(arg.name)
            if x is None:
                x = self._defaults[arg.name] = torch.full(self.table.physical(arg, {}), float(arg.default),
                                                          dtype=self.dtype, device=self.device)
        if arg.role == "cost_weight" and isinstance(u, Tensor) and u.dim() == 3:
            x = per_trajectory(self.table, arg, x, u.shape[0])
        return x

    def arguments(self, values: Sequence[Any]) -> list:
        """The call's values with each cost parameter as ``argument`` makes it (nothing kept: traced
        or transformed calls)."""
        out = list(values)
        for i in self.positions:
            out[i] = self.argument(self.table.tensors[i], values[i], values[0])
        return out

    def take(self, values: Sequence[Any]) -> tuple[list, Sequence[int], Optional[tuple]]:
        """The call's values with each cost parameter passed unchanged since it was kept replaced
        by its kept input, and the others as ``argument`` makes them; the positions that the
        argument checks must look at (``validate.check_inputs``' ``only``), in table order; and
        what ``keep`` takes after those checks (None: every parameter as kept). Nothing is kept
        between the two: calls from several threads cannot take each other's."""
        u = values[0]
        # the batch size: any tensor's (u is often an nn.Parameter); none known, nothing is reused
        batch = u.shape[0] if isinstance(u, Tensor) and u.dim() else None
        stamps: Optional[list] = [batch] if batch is not None else None
        for i in self.positions if stamps is not None else ():
            x = values[i]
            if x is None:
                stamps.append(None)
            elif type(x) in validate.TENSOR_TYPES:
                stamps.append(validate.stamp(x, id(x)))
            else:  # another subclass (its own view of versions and data) or no tensor: checked on every call
                stamps = None
                break
        out = list(values)
        kept = self._kept
        if kept is not None and stamps == kept[0]:  # the common call: every parameter as kept
            for i, x in zip(self.positions, kept[2]):
                out[i] = x
            return out, self.others, None
        same_batch = kept is not None and stamps is not None and stamps[0] == kept[0][0]
        fresh = []
        for j, i in enumerate(self.positions):
            if same_batch and stamps[j + 1] == kept[0][j + 1]:
                out[i] = kept[2][j]
            else:
                out[i] = self.argument(self.table.tensors[i], values[i], u)
                fresh.append(i)
        given = [values[i] for i in self.positions]
        return out, sorted((*self.others, *fresh)), (stamps, given, fresh)

    def keep(self, inputs: Sequence[Optional[Tensor]], taken: Optional[tuple]) -> None:
        """After the argument checks passed on ``take``'s values (``inputs``: what they returned):
        check the new or changed parameters' values (``check_parameter``), then keep them all."""
        if taken is None:  # every parameter as kept
            return
        stamps, given, fresh = taken
        for i in fresh:
            if inputs[i] is not None:
                check_parameter(self.table.tensors[i], inputs[i])
        if stamps is not None:
            self._kept = (stamps, given, [inputs[i] for i in self.positions])


def per_trajectory(table: ArgumentTable, arg: Argument, x: Any, batch: int) -> Any:
    """A [D] weight as the [B, D] rows the kernels read (a view); anything else as given. A 1-D
    tensor of another length is refused here, naming the shape given, not its expansion's."""
    if not (isinstance(x, Tensor) and x.dim() == 1):
        return x
    dof = table.size("D")
    if x.shape[0] != dof:
        raise ValueError(message("shape", name=arg.name, expected=f"({dof},) (one weight per dof) or (B, {dof})",
                                 got=validate.shape_text(x.shape)))
    return x.expand(batch, dof)


def holdable(table: ArgumentTable) -> tuple[str, ...]:
    """The keyword rows a fused step can hold (``Step.set_costs``), in table order: its cost
    parameters and the target."""
    return tuple(a.name for a in table.tensors if a.role.startswith("cost_"))


def check_held(table: ArgumentTable, given: dict[str, Any], dtype: torch.dtype, device: torch.device,
               order: Optional[int] = None) -> None:
    """``Step.set_costs``' checks, before anything is held, as a call checks the same keywords: each
    name is one of ``holdable`` (else the closest one is named, or what the spec, of that ``order``,
    lacks: arguments.py ``unknown_keyword``), then each tensor's type, shape, dtype and device, then a
    cost parameter's values (``check_parameter``). A ``[D]`` weight stands for every trajectory;
    ``[B, ...]`` tensors must agree on B (a call then checks it against u's)."""
    allowed = holdable(table)
    known = {a.name for a in table.tensors}
    for name in given:
        if name not in allowed:
            what = "a step holds its cost parameters only" if name in known else "no cost parameter of that name"
            raise TypeError(f"{name}: {what}; {unknown_keyword(name, allowed, table.costs, order)}")
    args = [a for a in table.tensors if a.name in given and given[a.name] is not None]
    # B from the first [B, ...] tensor of the right rank, so that a [D] weight checked before it agrees
    batch = next((given[a.name].shape[0] for a in args if a.shape and a.shape[0] == "B"
                  and isinstance(given[a.name], Tensor) and given[a.name].dim() == len(a.shape)), 1)
    dims: dict[str, int] = {}
    for arg in args:
        t = given[arg.name]
        if arg.role == "cost_weight":
            t = per_trajectory(table, arg, t, batch)
        checked = validate.check_argument(table, arg, t, dims, dtype, device)
        if validate.cost_parameter(arg):
            check_parameter(arg, checked)


class HeldParameters(dict):
    """A fused step's buffers (``Step.set_costs``), counting every change to which tensor is held:
    set, replaced or removed by ``register_buffer``, attribute assignment, ``.to()``,
    ``load_state_dict(assign=True)`` or ``torch.func.functional_call``. The native node keeps held
    parameters with the count they were checked at (``Step._forward``): a call after any such change
    takes the Python path, which checks them again (in-place writes and ``.data`` swaps are seen by
    each tensor's stamp, as for keyword tensors)."""

    changes = 0

    def __setitem__(self, key: str, value: Any) -> None:
        self.changes += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.changes += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.changes += 1
        return super().pop(*args)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.changes += 1
        super().update(*args, **kwargs)

    def clear(self) -> None:
        self.changes += 1
        super().clear()

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.changes += 1
        return super().setdefault(key, default)

    def popitem(self) -> tuple:
        self.changes += 1
        return super().popitem()

    def __ior__(self, other: Any) -> "HeldParameters":
        self.changes += 1
        return super().__ior__(other)


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
