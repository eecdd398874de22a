"""cuRobo v2's trajectory kernels on tensorstep: switch the import, keep working.

    from tensorstep.compat.curobo_v2 import CliqueTensorStepIdxKernel, BSplineIdxKernel, ...

The same four names as cuRobo v2's ``curobo._src.curobolib.cuda_ops.trajectory``, with the same
argument order: ``CliqueTensorStepIdxKernel`` (position actions, central differences, goal
state), ``AccelerationTensorStepIdxKernel`` (acceleration actions), ``BSplineIdxKernel``
(B-spline knots) and ``get_bspline_interpolation`` (dense replay). The kernel classes are real
``torch.autograd.Function`` subclasses running generated tensorstep kernels (C on the CPU,
CUDA on the GPU), float32 and float64, with the exact adjoint as backward, to the start, goal
and dt tensors too. Every argument is checked, with cuRobo's names, before any kernel runs;
errors are ``ArgumentError`` (a ValueError and a TypeError). The calls take what cuRobo's own
code passes: tables [..., dof] read as flat rows, [B] or [B, 1] int32/int64 indices, an out_dt
of at least B entries, and ``out_*`` buffers that the results are written into and returned as.
Names, formulas, the conventions, the quirks kept and the cases refused: docs/compat_curobo_v2.md.

>>> import torch
>>> from tensorstep.compat.curobo_v2 import CliqueTensorStepIdxKernel
>>> B, H, D = 2, 12, 3
>>> u = torch.zeros(B, H - 4, D, dtype=torch.float64, requires_grad=True)
>>> start, goal = torch.zeros(1, D, dtype=torch.float64), torch.ones(1, D, dtype=torch.float64)
>>> idx = torch.zeros(B, dtype=torch.int32)
>>> out = torch.empty(B, H, D, dtype=torch.float64)
>>> P, V, A, J = CliqueTensorStepIdxKernel.apply(
...     u, start, start, start, goal, goal, goal, idx, idx, out, None, None, None, None,
...     torch.tensor([0.1], dtype=torch.float64), torch.tensor([1], dtype=torch.uint8), None)
>>> P[0, -1].tolist()  # the goal is held from row H-3 on
[1.0, 1.0, 1.0]
>>> P.sum().backward(); u.grad[0, -1].tolist()  # the last action is replaced by the goal
[0.0, 0.0, 0.0]
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import torch

from ..codegen.arguments import message
from ..codegen.legacy_spec import LegacySpec
from ..codegen.curobo_v2_spec import BSPLINE_DEGREES, CLIQUE_MIN_HORIZON, CuroboV2Spec
from ..runtime.validate import _byte_range as byte_range, check_index_values, shape_text
from . import curobo as v07
from .curobo import TensorDeviceType

Tensor = torch.Tensor
DT_FLOOR = 1e-6  # the B-spline's knot spacing is max(dt, 1e-6)·s, as in cuRobo
FLAG_DTYPES = (torch.uint8, torch.bool)


@dataclasses.dataclass
class JointState(v07.JointState):
    """cuRobo's state fields, with v2's ``dt`` and, for B-spline trajectories, ``knot`` and ``knot_dt``."""

    dt: Optional[Tensor] = None
    knot: Optional[Tensor] = None
    knot_dt: Optional[Tensor] = None


# ---- checks (cuRobo's argument names; nothing here launches a kernel) ----------------------------

class ArgumentError(TypeError, ValueError):
    """A bad argument to one of these calls. cuRobo's own checks raise ValueError; PyTorch's
    conventions give TypeError for a wrong type or dtype: this class is both, so either
    ``except`` catches it."""


class IndexOutOfRange(ArgumentError, IndexError):
    """An index entry outside the table it picks rows from (also an IndexError, as PyTorch's)."""


def _curobo_errors(fn):
    """Raise the checks' TypeError, ValueError and IndexError as ArgumentError / IndexOutOfRange."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ArgumentError:
            raise
        except IndexError as err:
            raise IndexOutOfRange(str(err)) from None
        except (TypeError, ValueError) as err:
            raise ArgumentError(str(err)) from None

    return checked


def _tensor(name: str, t: Any, shape: Optional[Sequence[Optional[int]]], dtypes: Sequence[torch.dtype],
            device: Optional[torch.device], what: str = "") -> Tensor:
    """A dense tensor of the given shape (None: any size; shape None: any shape), one of ``dtypes``,
    on ``device``."""
    expected = "any shape" if shape is None else shape_text(["*" if s is None else s for s in shape])
    if not isinstance(t, Tensor):
        raise TypeError(message("type", name=name, expected=expected + what, got=type(t).__name__))
    if t.layout != torch.strided:
        raise TypeError(message("layout", name=name, got=t.layout))
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        raise ValueError(message("shape", name=name, expected=expected + what, got=shape_text(t.shape)))
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {allowed}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(message("device", name=name, expected=device, got=t.device))
    return t


def _floating(u_act: Any) -> Tensor:
    if not isinstance(u_act, Tensor):
        raise TypeError(message("type", name="u_act", expected="[B, rows, dof]", got=type(u_act).__name__))
    if u_act.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"u_act: expected dtype torch.float32 or torch.float64, got {u_act.dtype}")
    if u_act.dim() != 3:
        raise ValueError(f"u_act: expected 3 dims [B, rows, dof], got shape {shape_text(u_act.shape)}")
    if u_act.shape[0] == 0:
        raise ValueError(message("empty", name="u_act"))
    return u_act


def _rows(out_position: Any, u_act: Tensor, start_position: Any = None) -> int:
    """H, the output rows: out_position.shape[1], as cuRobo takes it. A u_act whose dof differs
    from both out_position's and start_position's is the one named."""
    B, _, D = u_act.shape
    if isinstance(out_position, Tensor) and isinstance(start_position, Tensor) and out_position.dim() == 3 \
            and start_position.dim() >= 1 and out_position.shape[2] == start_position.shape[-1] != D:
        raise ValueError(f"u_act: expected {out_position.shape[2]} dof (the last dimension of out_position and "
                         f"start_position), got shape {shape_text(u_act.shape)}")
    _tensor("out_position", out_position, (B, None, D), (u_act.dtype,), u_act.device,
            " (cuRobo's kernels take the number of rows from out_position)")
    return int(out_position.shape[1])


def _outputs(u_act: Tensor, H: int, buffers: dict[str, Any]) -> None:
    """cuRobo's out_* buffers: None, or distinct [B, H, dof] tensors of u_act's dtype and device."""
    B, _, D = u_act.shape
    seen: list[tuple[str, int, int]] = []
    for name, t in buffers.items():
        if t is None:
            continue
        _tensor(name, t, (B, H, D), (u_act.dtype,), u_act.device)
        if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
            raise ValueError(f"{name}: a leaf tensor that requires grad cannot be written in place; "
                             "pass a buffer that does not require grad")
        if torch._C._are_functorch_transforms_active():
            continue  # the buffers are not written under transforms (and have no addresses)
        lo, hi = byte_range(t)
        for other, olo, ohi in seen:
            if lo < ohi and olo < hi:
                raise ValueError(f"{name}: shares memory with {other}; each out_* buffer needs memory of its own")
        seen.append((name, lo, hi))


def _index(name: str, t: Any, B: int, device: torch.device) -> Tensor:
    """An index [B] or [B, 1] (cuRobo's goal registry makes the latter), int32 or int64, read flat."""
    if isinstance(t, Tensor) and t.dim() == 2 and t.shape[1] == 1:
        t = t.reshape(-1)
    return _tensor(name, t, (B,), (torch.int32, torch.int64), device, f" or ({B}, 1)")


def _table(name: str, t: Any, u_act: Tensor, rows: Optional[int] = None) -> Tensor:
    """A table of rows of dof: [rows, dof], or any shape [..., dof] ([batch, seeds, dof],
    [1, H, dof]) read as flat rows of dof, as cuRobo's kernels read it."""
    D = u_act.shape[2]
    if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[-1] == D:
        _tensor(name, t, None, (u_act.dtype,), u_act.device)
        flat = t.reshape(-1, D)
        if rows is None or flat.shape[0] == rows:
            return flat
        raise ValueError(message("shape", name=name, expected=shape_text((rows, D)) + " (read as flat rows of dof)",
                                 got=shape_text(t.shape)))
    return _tensor(name, t, (rows, D), (u_act.dtype,), u_act.device, " (or [..., dof], read as flat rows)")


def _states(names: Sequence[str], tensors: Sequence[Any], u_act: Tensor, optional_last: bool) -> list:
    """A state's tables [rows, dof], all with the first one's rows (the last may be None)."""
    first = _table(names[0], tensors[0], u_act)
    out = [first]
    for i, (name, t) in enumerate(zip(names[1:], tensors[1:]), 1):
        out.append(None if (t is None and optional_last and i == len(names) - 1)
                   else _table(name, t, u_act, first.shape[0]))
    return out


def _flat(name: str, t: Any, dtypes: Sequence[torch.dtype], device: torch.device) -> Tensor:
    """A flat table (traj_dt, use_implicit_goal_state): any shape, read as t.reshape(-1)."""
    if not isinstance(t, Tensor):
        raise TypeError(message("type", name=name, expected="a flat table read at goal_idx", got=type(t).__name__))
    _tensor(name, t, None, dtypes, device)
    return t.reshape(-1)


def _picked(goal_idx: Tensor, tables: dict[str, int]) -> None:
    """goal_idx's entries within every table it reads."""
    for rows_name, rows in tables.items():
        check_index_values("goal_idx", goal_idx, rows_name, rows)


def _dt_values(dt: Tensor, floor: bool) -> None:
    """Step durations read at goal_idx: finite and positive (the B-spline floors them at 1e-6)."""
    if dt.device.type != "cpu" or torch._C._are_functorch_transforms_active():
        return
    values = dt.detach().tolist()
    for b, x in enumerate(values):
        if not (x == x and abs(x) != float("inf")) or (not floor and x <= 0):
            raise ValueError(f"traj_dt: expected finite{'' if floor else ', positive'} step durations, got {x!r} "
                             f"at traj_dt[goal_idx[{b}]] (trajectory {b})")


def _check_out_dt(name: str, out_dt: Any, B: int, device: torch.device) -> None:
    """cuRobo's out_dt buffer: None, or any floating tensor of at least B elements, read flat."""
    if out_dt is None:
        return
    _tensor(name, out_dt, None, (torch.float32, torch.float64), device)
    if out_dt.numel() < B:
        raise ValueError(f"{name}: expected at least B = {B} elements (the first B are written), "
                         f"got shape {shape_text(out_dt.shape)}")
    if out_dt.dim() > 1 and not out_dt.is_contiguous():
        raise ValueError(f"{name}: expected a 1-D or contiguous tensor (written as flat entries), "
                         f"got shape {shape_text(out_dt.shape)} with strides {out_dt.stride()}")


def _out_dt(out_dt: Any, dt: Tensor, name: str = "out_dt") -> None:
    """Check out_dt, then write each trajectory's dt into its first B entries, as cuRobo's kernels do."""
    _check_out_dt(name, out_dt, dt.shape[0], dt.device)
    _write_out_dt(out_dt, dt)


def _write_out_dt(out_dt: Optional[Tensor], dt: Tensor) -> None:
    """Write dt into the first B entries of an out_dt already checked (``_check_out_dt``)."""
    if out_dt is None or torch._C._are_functorch_transforms_active():  # it cannot take transformed values
        return
    with torch.no_grad():
        out_dt.view(-1)[: dt.shape[0]].copy_(dt)


# ---- kernels ---------------------------------------------------------------------------------------

_STEPS: dict[tuple, Any] = {}


def _step(spec: CuroboV2Spec, device: torch.device) -> Any:
    import tensorstep as ts

    key = (spec, str(device))
    if key not in _STEPS:
        _STEPS[key] = ts.load(spec, device)
    return _STEPS[key]


def _dtype_name(t: Tensor) -> str:
    return "float32" if t.dtype == torch.float32 else "float64"


BUFFERS = ("out_position", "out_velocity", "out_acceleration", "out_jerk")


class _V2Kernel(torch.autograd.Function):
    """A kernel class: ``apply`` checks the arguments and calls ``_run(tensors, static, buffers)``.

    ``_call(*tensors, static)`` is the computation in torch terms (index gathers, the goal flag
    as a ``where``, then the generated step); forward runs it into cuRobo's ``out_*`` buffers
    (inputs of the Function that nothing differentiates) and returns them, so the results share
    the buffers' memory, as cuRobo's own Functions' do (autograd hands back an input returned
    from forward as an alias that carries the graph; the buffer objects stay plain tensors).
    Backward is the exact adjoint through ``_call`` (the step's own generated adjoint), jvp its
    tangent. Under functorch transforms (vmap, grad, jacfwd) ``_call`` runs directly, as the
    step supports them, and the buffers are left alone (they cannot hold transformed values).
    """

    DT = 0  # position of traj_dt among the tensors (set by each class)

    @classmethod
    def _step_inputs(cls, *args: Any) -> tuple[dict, Tensor]:  # pragma: no cover - defined by each class
        """(the step's inputs by their argument-table names, its dt) from the class's tensors:
        torch gathers and ``where`` only, linear in every floating input but dt."""
        raise NotImplementedError

    @classmethod
    def _dt_tangent(cls, inputs: list, tangents: list) -> Tensor:  # pragma: no cover - defined by each class
        """The tangent of the step's dt for the tangent of traj_dt."""
        raise NotImplementedError

    @classmethod
    def _call(cls, *args: Any, out: Optional[Sequence[Tensor]] = None) -> tuple:
        *tensors, spec = args
        named, dt = cls._step_inputs(*args)
        step = _step(spec, tensors[0].device)
        u, p0, v0, a0 = (named.pop(k) for k in ("u", "p0", "v0", "a0"))
        goal = tuple(named.pop(k) for k in ("gp", "gv", "ga", "gj")) if "gp" in named else None
        return step(u, p0, v0, a0, dt, goal=goal, out=out, **named)

    @classmethod
    def _run(cls, tensors: list, static: Any, buffers: Sequence[Any]) -> tuple:
        if torch._C._are_functorch_transforms_active():
            return tuple(cls._call(*tensors, static))
        if torch.autograd.forward_ad._current_level >= 0:
            # forward-mode AD: PyTorch drops the tangents of the outputs that follow an input
            # returned as-is, so here the results are new tensors, copied into the buffers
            outs = super().apply(*tensors, *(None,) * len(BUFFERS), static)
            with torch.no_grad():
                for b, y in zip(buffers, outs):
                    if b is not None:
                        b.copy_(y)
            return tuple(outs)
        return tuple(super().apply(*tensors, *buffers, static))

    @classmethod
    def forward(cls, *args: Any) -> tuple:  # type: ignore[override]
        """The step written straight into the contiguous buffers (no other output allocated);
        a strided buffer gets a copy, a missing one (None) a new tensor."""
        *tensors, static = args
        tensors, buffers = tensors[: -len(BUFFERS)], tensors[-len(BUFFERS):]
        u = tensors[0]
        shape = _step(static, u.device).launcher.output_shape(u.shape[0])
        into = [b if b is not None and b.is_contiguous() else u.new_empty(shape) for b in buffers]
        cls._call(*tensors, static, out=into)
        for b, y in zip(buffers, into):
            if b is not None and b is not y:
                b.copy_(y)
        return tuple(y if b is None else b for b, y in zip(buffers, into))

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, static = inputs
        tensors = tensors[: -len(BUFFERS)]  # the buffers are overwritten by later calls: never saved
        ctx.static = static
        ctx.present = [t is not None for t in tensors]
        ctx.save_for_backward(*(t for t in tensors if t is not None))
        ctx.save_for_forward(*(t for t in tensors if t is not None))

    @staticmethod
    def _inputs(ctx) -> list:
        saved = iter(ctx.saved_tensors)
        return [next(saved) if present else None for present in ctx.present]

    @classmethod
    def backward(cls, ctx, *grads):  # type: ignore[override]
        inputs = cls._inputs(ctx)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[: len(inputs)]) if need]
        create_graph = torch.is_grad_enabled()  # double backward (read before enable_grad)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(i in wanted) if t is not None else None for i, t in enumerate(inputs)]
            got = torch.autograd.grad(cls._call(*leaves, ctx.static), [leaves[i] for i in wanted], grads,
                                      allow_unused=True, create_graph=create_graph)
        result: list[Optional[Tensor]] = [None] * (len(inputs) + len(BUFFERS) + 1)  # none to buffers, static
        for i, g in zip(wanted, got):
            result[i] = g if g is not None else torch.zeros_like(inputs[i])
        return tuple(result)

    @classmethod
    def jvp(cls, ctx, *tangents):  # type: ignore[override]
        """Ṁx + Mẋ: the step's inputs and their tangents (the same gathers applied to the tangents),
        then the step's generated dt_jvp kernel."""
        from ..runtime.autograd import DtJvpFunction

        inputs, spec = cls._inputs(ctx), ctx.static
        tangents = [dx if dx is not None or x is None or not x.is_floating_point() else torch.zeros_like(x)
                    for x, dx in zip(inputs, tangents[: len(inputs)])]
        tangent_args = [dx if x is not None and x.is_floating_point() else x for x, dx in zip(inputs, tangents)]
        named, dt = cls._step_inputs(*inputs, spec)
        d_named, _ = cls._step_inputs(*tangent_args, spec)
        ddt = cls._dt_tangent(inputs, tangents)
        step = _step(spec, inputs[0].device)
        table = step.table
        named["start_index"] = named["start_index"].long()
        values = [None if named.get(a.name) is None else named[a.name].contiguous() for a in table.tensors]
        d_values = [None if d_named.get(a.name) is None else d_named[a.name].contiguous() for a in table.differentiable]
        return tuple(DtJvpFunction.apply(step.launcher, dt.contiguous(), ddt.contiguous(), *values, *d_values))


def _rows_at(table: Tensor, idx: Tensor) -> Tensor:
    """table's rows at an index (index_select: torch's advanced indexing is far slower on the CPU)."""
    return table.index_select(0, idx)


def _gather_dt(traj_dt: Tensor, goal_idx: Tensor) -> Tensor:
    return _rows_at(traj_dt.reshape(-1), goal_idx)


def _goal_flag(flag: Tensor, goal_idx: Tensor) -> Tensor:
    """cuRobo's use_implicit_goal_state read at goal_idx, as a [B, 1] boolean."""
    return (_rows_at(flag.reshape(-1), goal_idx) != 0).unsqueeze(1)


class CliqueTensorStepIdxKernel(_V2Kernel):
    """cuRobo v2's position kernel: H − 4 actions, five-point central differences, goal state.

    ``apply(u_act, start_position, start_velocity, start_acceleration, goal_position,
    goal_velocity, goal_acceleration, start_idx, goal_idx, out_position, out_velocity,
    out_acceleration, out_jerk, out_dt, traj_dt, use_implicit_goal_state, out_grad_position)``
    → (P, V, A, J) [B, H, dof], H = out_position.shape[1] ≥ 9. dt and the flag are read at
    goal_idx; goal velocity and acceleration are never read. Exact gradients to u_act, the start
    and goal positions and traj_dt.
    """

    @classmethod
    @_curobo_errors
    def apply(cls, u_act, start_position, start_velocity, start_acceleration, goal_position, goal_velocity,
              goal_acceleration, start_idx, goal_idx, out_position, out_velocity, out_acceleration, out_jerk,
              out_dt, traj_dt, use_implicit_goal_state, out_grad_position):  # type: ignore[override]
        u_act = _floating(u_act)
        H = _rows(out_position, u_act, start_position)
        B, A, D = u_act.shape
        if H < CLIQUE_MIN_HORIZON:
            raise ValueError(f"out_position: H = {H} rows; the position kernel needs H >= {CLIQUE_MIN_HORIZON} "
                             "(cuRobo reads outside its tensors below that)")
        if A != H - 4:
            raise ValueError(f"u_act: expected u_act.shape[-2] = H - 4 = {H - 4} actions for H = {H} rows "
                             f"(out_position.shape[1]), got shape {shape_text(u_act.shape)}")
        buffers = dict(zip(BUFFERS, (out_position, out_velocity, out_acceleration, out_jerk)))
        _outputs(u_act, H, buffers)
        starts = _states(("start_position", "start_velocity", "start_acceleration"),
                         (start_position, start_velocity, start_acceleration), u_act, False)
        goal_position = _table("goal_position", goal_position, u_act)
        start_idx, goal_idx = _index("start_idx", start_idx, B, u_act.device), _index("goal_idx", goal_idx, B, u_act.device)
        traj_dt = _flat("traj_dt", traj_dt, (u_act.dtype,), u_act.device)
        flag = _flat("use_implicit_goal_state", use_implicit_goal_state, FLAG_DTYPES, u_act.device)
        check_index_values("start_idx", start_idx, "start_position, start_velocity, start_acceleration",
                           starts[0].shape[0])
        _picked(goal_idx, {"goal_position": goal_position.shape[0], "traj_dt": traj_dt.shape[0],
                           "use_implicit_goal_state": flag.shape[0]})
        dt = _gather_dt(traj_dt, goal_idx)
        _dt_values(dt, floor=False)
        _out_dt(out_dt, dt.detach())
        spec = CuroboV2Spec("clique", H, D, _dtype_name(u_act))
        tensors = [u_act, *starts, goal_position, start_idx, goal_idx, traj_dt, flag]
        return cls._run(tensors, spec, buffers.values())

    DT, GOAL_IDX = 7, 6  # positions of traj_dt and goal_idx among the tensors

    @classmethod
    def _dt_tangent(cls, inputs: list, tangents: list) -> Tensor:
        return _gather_dt(tangents[cls.DT], inputs[cls.GOAL_IDX])  # a gather: linear

    @classmethod
    def _step_inputs(cls, u, p, v, a, goal_p, start_idx, goal_idx, traj_dt, flag, spec):  # type: ignore[override]
        """L = goal_position[goal_idx] where the flag is set, else the last action; the kernel
        holds L from row H − 3 on (its goal entry) and never reads u's last row itself."""
        held = torch.where(_goal_flag(flag, goal_idx), _rows_at(goal_p, goal_idx), u[:, -1])
        zero = torch.zeros_like(held)
        named = {"u": u.contiguous(), "p0": p.contiguous(), "v0": v.contiguous(), "a0": a.contiguous(),
                 "start_index": start_idx, "gp": held, "gv": zero, "ga": zero, "gj": None}
        return named, _gather_dt(traj_dt, goal_idx)


class AccelerationTensorStepIdxKernel(_V2Kernel):
    """cuRobo v2's acceleration kernel (semi-implicit Euler, one traj_dt per time step shared by
    the batch, traj_dt[0] unused): the generated kernel of v0.7's class of that name.

    ``apply(u_act, start_position, start_velocity, start_acceleration, start_idx, out_position,
    out_velocity, out_acceleration, out_jerk, traj_dt, out_grad_position)`` → (P, V, A, J);
    exact backward (cuRobo raises NotImplementedError), to the start tensors and traj_dt too.
    """

    @classmethod
    @_curobo_errors
    def apply(cls, u_act, start_position, start_velocity, start_acceleration, start_idx, out_position,
              out_velocity, out_acceleration, out_jerk, traj_dt, out_grad_position):  # type: ignore[override]
        u_act = _floating(u_act)
        B, H, D = u_act.shape
        if out_position is not None and _rows(out_position, u_act, start_position) != H:
            raise ValueError(f"u_act: expected u_act.shape[-2] = H = {out_position.shape[1]} "
                             f"(out_position.shape[1]), got shape {shape_text(u_act.shape)}")
        buffers = dict(zip(BUFFERS, (out_position, out_velocity, out_acceleration, out_jerk)))
        _outputs(u_act, H, buffers)
        starts = _states(("start_position", "start_velocity", "start_acceleration"),
                         (start_position, start_velocity, start_acceleration), u_act, False)
        start_idx = _index("start_idx", start_idx, B, u_act.device)
        flat = _flat("traj_dt", traj_dt, (u_act.dtype,), u_act.device)
        if flat.shape[0] < H:
            raise ValueError(f"traj_dt: expected at least H = {H} step durations (one per row), "
                             f"got shape {shape_text(traj_dt.shape)}")
        check_index_values("start_idx", start_idx, "start_position, start_velocity, start_acceleration",
                           starts[0].shape[0])
        spec = LegacySpec("accel_semi_euler", H, D, _dtype_name(u_act), start_index=True)
        return cls._run([u_act, *starts, start_idx, flat], spec, buffers.values())

    DT = 5  # position of traj_dt among the tensors

    @classmethod
    def _step_inputs(cls, u, p, v, a, start_idx, traj_dt, spec):  # type: ignore[override]
        """The first H entries of traj_dt, one per row."""
        named = {"u": u.contiguous(), "p0": p.contiguous(), "v0": v.contiguous(), "a0": a.contiguous(),
                 "start_index": start_idx}
        return named, traj_dt[: spec.horizon]

    @classmethod
    def _dt_tangent(cls, inputs: list, tangents: list) -> Tensor:
        return tangents[cls.DT][: inputs[0].shape[1]]  # H = u_act.shape[1] entries, one per row


class BSplineIdxKernel(_V2Kernel):
    """cuRobo v2's B-spline kernel: knots u_act [B, n, dof], degree 3–5, R = out_position.shape[1]
    rows, s = ⌊(R − 1)/T⌋ rows per span (T = n + degree + 1).

    ``apply(u_act, start_position, start_velocity, start_acceleration, start_jerk, goal_position,
    goal_velocity, goal_acceleration, goal_jerk, start_idx, goal_idx, out_position, out_velocity,
    out_acceleration, out_jerk, out_dt, traj_dt, use_implicit_goal_state, out_grad_position,
    bspline_degree, use_flat_gradient=False)`` → (P, V, A, J) [B, R, dof]. dt (the row spacing)
    and the flag are read at goal_idx; the knot spacing is max(dt, 1e-6)·s. The backward is
    exact for every s, to the knots, the start and goal states and traj_dt.
    """

    @classmethod
    @_curobo_errors
    def apply(cls, u_act, start_position, start_velocity, start_acceleration, start_jerk, goal_position,
              goal_velocity, goal_acceleration, goal_jerk, start_idx, goal_idx, out_position, out_velocity,
              out_acceleration, out_jerk, out_dt, traj_dt, use_implicit_goal_state, out_grad_position,
              bspline_degree, use_flat_gradient=False):  # type: ignore[override]
        u_act = _floating(u_act)
        R = _rows(out_position, u_act, start_position)
        buffers = dict(zip(BUFFERS, (out_position, out_velocity, out_acceleration, out_jerk)))
        _outputs(u_act, R, buffers)
        tensors = _bspline_inputs(
            u_act, (start_position, start_velocity, start_acceleration, start_jerk),
            (goal_position, goal_velocity, goal_acceleration, goal_jerk), start_idx, goal_idx, traj_dt,
            use_implicit_goal_state, bspline_degree)
        T = u_act.shape[1] + bspline_degree + 1
        if (R - 1) // T < 1:
            raise ValueError(f"out_position: {R} rows cannot hold {T} spans (n + bspline_degree + 1) of at least "
                             f"one row each: expected at least {T + 1} rows, got shape {shape_text(out_position.shape)}")
        dt = _gather_dt(tensors[cls.DT], tensors[cls.GOAL_IDX])
        _dt_values(dt, floor=True)
        _out_dt(out_dt, dt.detach())
        spec = CuroboV2Spec("bspline", R, u_act.shape[2], _dtype_name(u_act), bspline_degree, u_act.shape[1],
                            (R - 1) // T)
        return cls._run(tensors, spec, buffers.values())

    DT, GOAL_IDX = 11, 10  # positions of traj_dt and goal_idx among the tensors

    @classmethod
    def _step_inputs(cls, u, p, v, a, j, gp, gv, ga, gj, start_idx, goal_idx, traj_dt, flag, spec):  # type: ignore[override]
        """The tail's boundary state: the goal where the flag is set, else (u_{n−1}, 0, 0, 0)
        (its boundary points are u_{n−1} repeated); the kernel never reads u's last row itself.
        dt is floored at 1e-6, as cuRobo does."""
        use_goal = _goal_flag(flag, goal_idx)
        held = torch.where(use_goal, _rows_at(gp, goal_idx), u[:, -1])
        tail = [held] + [torch.where(use_goal, _rows_at(x, goal_idx), 0.0) if x is not None else torch.zeros_like(held)
                         for x in (gv, ga, gj)]
        named = {"u": u.contiguous(), "p0": p.contiguous(), "v0": v.contiguous(), "a0": a.contiguous(),
                 "j0": j.contiguous() if j is not None else None, "start_index": start_idx,
                 **dict(zip(("gp", "gv", "ga", "gj"), tail))}
        return named, _gather_dt(traj_dt, goal_idx).clamp(min=DT_FLOOR)

    @classmethod
    def _dt_tangent(cls, inputs: list, tangents: list) -> Tensor:
        """max(dt, 1e-6): the tangent passes where dt is above the floor."""
        goal_idx = inputs[cls.GOAL_IDX]
        return _gather_dt(tangents[cls.DT], goal_idx) * (_gather_dt(inputs[cls.DT], goal_idx) >= DT_FLOOR)


def _bspline_inputs(u_act: Tensor, start: Sequence[Any], goal: Sequence[Any], start_idx: Any, goal_idx: Any,
                    traj_dt: Any, flag: Any, degree: Any) -> list:
    """The B-spline's checked inputs, in the order ``BSplineIdxKernel._step_inputs`` takes them."""
    B, n, _ = u_act.shape
    if isinstance(degree, bool) or degree not in BSPLINE_DEGREES:
        raise ValueError(f"bspline_degree: expected one of {', '.join(map(str, BSPLINE_DEGREES))}, got {degree!r}")
    starts = _states(("start_position", "start_velocity", "start_acceleration", "start_jerk"), start, u_act, True)
    goals = _states(("goal_position", "goal_velocity", "goal_acceleration", "goal_jerk"), goal, u_act, True)
    start_idx, goal_idx = _index("start_idx", start_idx, B, u_act.device), _index("goal_idx", goal_idx, B, u_act.device)
    traj_dt = _flat("traj_dt", traj_dt, (u_act.dtype,), u_act.device)
    flag = _flat("use_implicit_goal_state", flag, FLAG_DTYPES, u_act.device)
    check_index_values("start_idx", start_idx, "start_position, ...", starts[0].shape[0])
    _picked(goal_idx, {"goal_position": goals[0].shape[0], "traj_dt": traj_dt.shape[0],
                       "use_implicit_goal_state": flag.shape[0]})
    _small_n(n, degree, flag, goal_idx)
    return [u_act, *starts, *goals, start_idx, goal_idx, traj_dt, flag]


def _small_n(n: int, degree: int, flag: Tensor, goal_idx: Tensor) -> None:
    """Refuse the knot counts where a span would be both a start and a goal boundary: n ≤ degree − 1,
    and n = degree for trajectories whose flag is set (cuRobo's curve breaks there)."""
    def refused(with_flag: str) -> str:
        return (f"u_act: {n} knots with bspline_degree={degree}{with_flag}: a span would be both a start and "
                f"a goal boundary, where cuRobo's result is wrong; use at least {degree + 1} knots "
                f"(or {degree} with the flag off)")

    if n <= degree - 1:
        raise ValueError(refused(""))
    if n == degree:
        flagged = _goal_flag(flag, goal_idx).any()
        if flag.device.type != "cpu":  # a device-side assert: no host synchronisation (CUDA-graph capture)
            torch._assert_async(~flagged, refused(" with use_implicit_goal_state set"))
        elif bool(flagged):
            raise ValueError(refused(" with use_implicit_goal_state set"))


def _field(obj: Any, owner: str, name: str, optional: bool = False) -> Any:
    if not hasattr(obj, name):
        raise TypeError(f"{owner}: expected an object with .{name} (a JointState), got {type(obj).__name__}")
    value = getattr(obj, name)
    if value is None and not optional:
        raise TypeError(f"{owner}.{name}: expected a tensor, got None")
    return value


@_curobo_errors
def get_bspline_interpolation(input_trajectory: Any, output_trajectory: Any, interpolation_dt: Tensor,
                              current_state: Any, goal_state: Any, start_idx: Tensor, goal_idx: Tensor,
                              use_implicit_goal_state: Tensor, interpolated_horizon: Tensor,
                              bspline_degree: int = 4) -> Any:
    """Dense replay of B-spline knots for execution (no autograd), cuRobo v2's function.

    Per trajectory b: H_b = min(interpolated_horizon[b], max_out − 1), s_b = ⌊H_b/T⌋ rows per
    span, knot spacing max(interpolation_dt[0], 1e-6)·s_b; rows 0..max_out − 1 follow
    ``BSplineIdxKernel``'s rule (rows from T·s_b on hold the end state). Writes
    ``output_trajectory``'s position, velocity, acceleration, jerk and dt (= interpolation_dt[0])
    and returns it. The states are any objects with cuRobo's fields (``JointState`` here).
    """
    knots = _floating(_field(input_trajectory, "input_trajectory", "knot"))
    _field(input_trajectory, "input_trajectory", "knot_dt", optional=True)  # validated, never read, as in cuRobo
    B, n, D = knots.shape
    outs = [_field(output_trajectory, "output_trajectory", f) for f in ("position", "velocity", "acceleration", "jerk")]
    start = [_field(current_state, "current_state", f, optional=f == "jerk")
             for f in ("position", "velocity", "acceleration", "jerk")]
    max_out = _rows(outs[0], knots, start[0])
    _outputs(knots, max_out, dict(zip(("output_trajectory.position", "output_trajectory.velocity",
                                       "output_trajectory.acceleration", "output_trajectory.jerk"), outs)))
    out_dt = _field(output_trajectory, "output_trajectory", "dt")
    _check_out_dt("output_trajectory.dt", out_dt, B, knots.device)
    goal = [_field(goal_state, "goal_state", f, optional=f == "jerk")
            for f in ("position", "velocity", "acceleration", "jerk")]
    dt_in = _flat("interpolation_dt", interpolation_dt, (knots.dtype,), knots.device)
    if dt_in.shape[0] < 1:
        raise ValueError("interpolation_dt: expected at least one entry, got none")
    horizon = _index("interpolated_horizon", interpolated_horizon, B, knots.device)
    goal_rows = goal[0].numel() // D if isinstance(goal[0], Tensor) else 1  # checked below
    # every trajectory's dt is interpolation_dt[0]: a dt table read at goal_idx like the kernel's
    dt_table = dt_in[:1].expand(goal_rows)
    tensors = _bspline_inputs(knots, start, goal, start_idx, goal_idx, dt_table, use_implicit_goal_state,
                              bspline_degree)
    T = n + bspline_degree + 1
    steps = (horizon.clamp(max=max_out - 1) // T).tolist()
    short = [b for b in range(B) if steps[b] < 1]
    if short:
        raise ValueError(f"interpolated_horizon: entry {int(horizon[short[0]])} (trajectory {short[0]}) leaves fewer "
                         f"rows than the {T} spans (n + bspline_degree + 1): every span needs at least one row")
    _dt_values(dt_in[:1], floor=True)
    u, *states, sidx, gidx, _, flag = tensors
    with torch.no_grad():
        for s in sorted(set(steps)):
            rows = torch.tensor([b for b in range(B) if steps[b] == s], device=knots.device)
            spec = CuroboV2Spec("bspline", max_out, D, _dtype_name(knots), bspline_degree, n, s)
            result = BSplineIdxKernel._call(_rows_at(u, rows), *states, _rows_at(sidx, rows), _rows_at(gidx, rows),
                                            dt_table, flag, spec)
            for y, out in zip(result, outs):
                out.index_copy_(0, rows, y)
    _write_out_dt(out_dt, dt_in[:1].expand(B))  # checked above, before any kernel ran
    return output_trajectory


__all__ = ["TensorDeviceType", "JointState", "CliqueTensorStepIdxKernel", "AccelerationTensorStepIdxKernel",
           "BSplineIdxKernel", "get_bspline_interpolation"]
