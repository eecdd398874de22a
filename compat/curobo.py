"""cuRobo's `integration_utils` names on tensorstep: switch the import, keep working.

    from tensorstep.compat.curobo import CliqueTensorStepKernel, build_fd_matrix, ...

Forward results match cuRobo's wherever cuRobo completes a call; the kernel classes are
tensorstep kernels (generated C on CPU, generated CUDA on GPU) with exact gradients, also
where cuRobo approximates (last central action), refuses (acceleration backward) or breaks
(the Idx backward-difference and Coalesce kernels). Every name, its formulas and each
difference from cuRobo: docs/compat_curobo.md.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch

from ..codegen.legacy_spec import LegacySpec

Tensor = torch.Tensor


# ---- stand-ins ----------------------------------------------------------------------------------

@dataclasses.dataclass
class TensorDeviceType:
    """Device and dtype of the tensors a builder makes (cuRobo's field names)."""

    device: Any = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def as_torch_dict(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype}


@dataclasses.dataclass
class JointState:
    """Joint-space state with cuRobo's field names; supports unsqueeze and batch indexing."""

    position: Optional[Tensor] = None
    velocity: Optional[Tensor] = None
    acceleration: Optional[Tensor] = None
    jerk: Optional[Tensor] = None
    joint_names: Optional[list] = None

    FIELDS = ("position", "velocity", "acceleration", "jerk")

    def _map(self, fn) -> "JointState":
        values = {f: (fn(getattr(self, f)) if getattr(self, f) is not None else None) for f in self.FIELDS}
        return JointState(**values, joint_names=self.joint_names)

    def unsqueeze(self, dim: int) -> "JointState":
        return self._map(lambda t: t.unsqueeze(dim))

    def __getitem__(self, index: Any) -> "JointState":
        return self._map(lambda t: t[index])


# ---- matrix builders ------------------------------------------------------------------------------

def _eye(n: int, device: Any, dtype: torch.dtype) -> Tensor:
    return torch.eye(n, device=device, dtype=dtype)


def _forward_difference(horizon: int, device: Any, dtype: torch.dtype, shift: bool) -> Tensor:
    F = torch.zeros(horizon, horizon, device=device, dtype=dtype)
    if horizon > 1:
        i = torch.arange(horizon - 1, device=device)
        if shift:
            F[i + 1, i] = -1.0
            F[i + 1, i + 1] = 1.0
        else:
            F[i, i] = -1.0
            F[i, i + 1] = 1.0
    return F


def build_fd_matrix(horizon: int, device: Any = "cpu", dtype: torch.dtype = torch.float32, order: int = 1,
                    PREV_STATE: bool = False, FULL_RANK: bool = False, SHIFT: bool = False) -> Tensor:
    """Finite-difference matrices: the default, SHIFT, PREV_STATE and FULL_RANK forms (docs/compat_curobo.md)."""
    if PREV_STATE:
        G = build_fd_matrix(horizon + order, device=device, dtype=dtype, order=1)
        return -torch.linalg.matrix_power(G, order)[:horizon, :]
    if FULL_RANK:
        if horizon % 2 == 0:
            raise ValueError(f"build_fd_matrix: FULL_RANK needs an odd horizon, got {horizon}")
        F = _eye(horizon, device, dtype)
        mid = horizon // 2
        for i in range(horizon):
            if i < mid:
                F[i, i + 1] -= 1.0
            elif i > mid:
                F[i, i - 1] -= 1.0
        F[mid, :] = 0.0
        F[mid, mid - 1], F[mid, mid + 1] = -1.0, 1.0
        return torch.linalg.matrix_power(F, order)
    return torch.linalg.matrix_power(_forward_difference(horizon, device, dtype, SHIFT), order)


def build_int_matrix(horizon: int, diagonal: int = 0, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                     order: int = 1, traj_dt: Optional[Tensor] = None) -> Tensor:
    """Integration matrices: tril(ones)^order, or (tril(ones)·diag(traj_dt))^order."""
    L = torch.tril(torch.ones(horizon, horizon, device=device, dtype=dtype), diagonal=diagonal)
    if traj_dt is not None:
        L = L @ torch.diag(traj_dt.to(device=device, dtype=dtype))
    return torch.linalg.matrix_power(L, order)


def _subdiagonal(horizon: int, device: Any, dtype: torch.dtype) -> Tensor:
    return torch.diag(torch.ones(horizon - 1, device=device, dtype=dtype), -1)


def build_clique_matrix(horizon: int, dt: Tensor, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """[S; Vm; Am] (3H×H): S sub-diagonal ones, Vm = diag(1/dt)(I - S) with Vm[0,0] = 0, Am = diag(1/dt)·Vm."""
    S = _subdiagonal(horizon, device, dtype)
    inv = torch.diag(1.0 / dt.to(device=device, dtype=dtype))
    Vm = inv @ (_eye(horizon, device, dtype) - S)
    Vm[0, 0] = 0.0
    Am = inv @ Vm
    return torch.cat([S, Vm, Am], 0)


def build_start_state_mask(horizon: int, tensor_args: TensorDeviceType) -> tuple[Tensor, Tensor]:
    """(mask H×1 with mask[0,0] = 1, n_mask = sub-diagonal ones H×H)."""
    mask = torch.zeros(horizon, 1, **tensor_args.as_torch_dict())
    mask[0, 0] = 1.0
    return mask, _subdiagonal(horizon, tensor_args.device, tensor_args.dtype)


def sum_matrix(h: int, int_steps: int, tensor_args: TensorDeviceType) -> Tensor:
    M = torch.zeros((h - 1) * int_steps, h, **tensor_args.as_torch_dict())
    for i in range(h - 1):
        M[i * int_steps : (i + 1) * int_steps, i] = 1.0
    return M


def interpolate_kernel(h: int, int_steps: int, tensor_args: TensorDeviceType) -> Tensor:
    M = torch.zeros((h - 1) * int_steps, h, **tensor_args.as_torch_dict())
    delta = [k / (int_steps - 1) for k in range(int_steps)]
    for i in range(h - 1):
        for k in range(int_steps):
            M[i * int_steps + k, i] = delta[int_steps - 1 - k]
            M[i * int_steps + k, i + 1] = delta[k]
    return M


def action_interpolate_kernel(h: int, int_steps: int, tensor_args: TensorDeviceType, offset: int = 4) -> Tensor:
    M = torch.zeros((h - 1) * int_steps, h, **tensor_args.as_torch_dict())
    span = int_steps - offset  # 0 (offset = int_steps): no ramp rows, as in cuRobo
    for i in range(h - 1):
        for k in range(span):
            M[i * int_steps + k, i] = (span - 1 - k) / span
            M[i * int_steps + k, i + 1] = (k + 1) / span
    M[-offset:, 1] = 1.0  # cuRobo's quirk (column 1; with offset 0 every row, as M[-0:] is), kept
    return M


def tensor_linspace(start_tensor: Tensor, end_tensor: Tensor, steps: int = 10) -> Tensor:
    """start + c·(end - start), c_k = (k+1)/steps: [..., steps] for inputs whose last dimension
    is 1 (cuRobo's broadcast), else along a new last dimension [..., n, steps]."""
    c = torch.arange(1, steps + 1, device=start_tensor.device, dtype=start_tensor.dtype) / steps
    dist = end_tensor - start_tensor
    if dist.dim() and dist.shape[-1] == 1:
        return start_tensor + c * dist
    return start_tensor.unsqueeze(-1) + c * dist.unsqueeze(-1)


# ---- dense-matrix steps (pure torch; autograd through torch) --------------------------------------

def euler_integrate(q_0: Tensor, u: Tensor, diag_dt: Tensor, integrate_matrix: Tensor) -> Tensor:
    return q_0 + integrate_matrix @ u


def _blocks(state: Tensor, n: int, count: int) -> list[Tensor]:
    return [state[..., i * n : (i + 1) * n] for i in range(count)]


def tensor_step_acc(state: Tensor, act: Tensor, state_seq: Tensor, dt_h: Tensor, n_dofs: int,
                    integrate_matrix: Tensor, fd_matrix: Optional[Tensor] = None) -> Tensor:
    q, qd = _blocks(state, n_dofs, 2)
    qd_new = euler_integrate(qd, act, dt_h, integrate_matrix)
    q_new = euler_integrate(q, qd_new, dt_h, integrate_matrix)
    state_seq[..., :n_dofs] = q_new
    state_seq[..., n_dofs : 2 * n_dofs] = qd_new
    state_seq[..., 2 * n_dofs : 3 * n_dofs] = act
    return state_seq


def tensor_step_jerk(state: Tensor, act: Tensor, state_seq: Tensor, dt_h: Tensor, n_dofs: int,
                     integrate_matrix: Tensor, fd_matrix: Optional[Tensor] = None) -> Tensor:
    q, qd, qdd = _blocks(state, n_dofs, 3)
    M = integrate_matrix @ torch.diag(dt_h)
    qdd_new = qdd + M @ act
    qd_new = qd + M @ qdd_new
    q_new = q + M @ qd_new
    state_seq[..., :n_dofs] = q_new
    state_seq[..., n_dofs : 2 * n_dofs] = qd_new
    state_seq[..., 2 * n_dofs : 3 * n_dofs] = qdd_new
    return state_seq


def step_acc_semi_euler(state: Tensor, act: Tensor, diag_dt: Tensor, n_dofs: int, integrate_matrix: Tensor) -> Tensor:
    q, qd = _blocks(state, n_dofs, 2)
    qd_new = euler_integrate(qd, act, diag_dt, integrate_matrix)
    q_new = euler_integrate(q, qd_new, diag_dt, integrate_matrix)
    return torch.cat((q_new, qd_new, act), dim=-1)


def tensor_step_acc_semi_euler(state: JointState, act: Tensor, state_seq: JointState, diag_dt: Tensor,
                               integrate_matrix: Tensor, integrate_matrix_pos: Tensor) -> JointState:
    s = state.unsqueeze(1)
    qd_new = s.velocity + integrate_matrix @ act
    q_new = s.position + integrate_matrix_pos @ qd_new
    state_seq.acceleration = act
    state_seq.velocity = qd_new
    state_seq.position = q_new
    return state_seq


def tensor_step_vel(state: Tensor, act: Tensor, state_seq: Tensor, dt_h: Tensor, n_dofs: int,
                    integrate_matrix: Tensor, fd_matrix: Tensor) -> Tensor:
    n = n_dofs
    state_seq[:, 0, : 3 * n] = state
    state_seq[:, 1:, n : 2 * n] = act[:, :-1]
    velocity = state_seq[..., n : 2 * n]
    state_seq[..., :n] = state[..., :n].unsqueeze(1) + integrate_matrix @ velocity
    state_seq[:, 1:, 2 * n : 3 * n] = (torch.diag(1.0 / dt_h) @ fd_matrix @ velocity)[:, :-1]
    return state_seq


def tensor_step_pos(state: JointState, act: Tensor, state_seq: JointState, fd_matrix: Tensor) -> JointState:
    state_seq.position[:, 0] = state.position
    state_seq.velocity[:, 0] = state.velocity
    state_seq.acceleration[:, 0] = state.acceleration
    state_seq.position[:, 1:] = act[:, :-1]
    state_seq.velocity[:, 1:] = (fd_matrix @ state_seq.position)[:, :-1]
    state_seq.acceleration[:, 1:] = (fd_matrix @ state_seq.velocity)[:, :-1]
    return state_seq


def tensor_step_pos_ik(act: Tensor, state_seq: JointState) -> JointState:
    state_seq.position = act
    return state_seq


def jit_tensor_step_pos_clique(pos_act: Tensor, start_position: Tensor, mask: Tensor, n_mask: Tensor,
                               fd_1: Tensor, fd_2: Tensor, fd_3: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p = mask @ start_position.unsqueeze(1) + n_mask @ pos_act
    return p, fd_1 @ p, fd_2 @ p, fd_3 @ p


def jit_backward_pos_clique(grad_p: Tensor, grad_v: Tensor, grad_a: Tensor, grad_j: Tensor, n_mask: Tensor,
                            fd_1: Tensor, fd_2: Tensor, fd_3: Tensor) -> Tensor:
    return n_mask.transpose(-1, -2) @ (
        grad_p + fd_3.transpose(-1, -2) @ grad_j + fd_2.transpose(-1, -2) @ grad_a + fd_1.transpose(-1, -2) @ grad_v
    )


def jit_tensor_step_pos_clique_contiguous(pos_act, start_position, mask, n_mask, fd_1, fd_2, fd_3):
    return jit_tensor_step_pos_clique(pos_act, start_position, mask, n_mask, fd_1, fd_2, fd_3)


def jit_backward_pos_clique_contiguous(grad_p, grad_v, grad_a, grad_j, n_mask, fd_1, fd_2, fd_3):
    return jit_backward_pos_clique(grad_p, grad_v, grad_a, grad_j, n_mask, fd_1, fd_2, fd_3)


class CliqueTensorStep(torch.autograd.Function):
    """Dense clique step: forward = jit_tensor_step_pos_clique, backward to u_act only."""

    @staticmethod
    def forward(ctx, u_act, start_position, mask, n_mask, fd_1, fd_2, fd_3):
        ctx.save_for_backward(n_mask, fd_1, fd_2, fd_3)
        return jit_tensor_step_pos_clique(u_act, start_position, mask, n_mask, fd_1, fd_2, fd_3)

    @staticmethod
    def backward(ctx, grad_p, grad_v, grad_a, grad_j):
        n_mask, fd_1, fd_2, fd_3 = ctx.saved_tensors
        grads = [g if g is not None else torch.zeros_like(grad_p if grad_p is not None else grad_v)
                 for g in (grad_p, grad_v, grad_a, grad_j)]
        return jit_backward_pos_clique(*grads, n_mask, fd_1, fd_2, fd_3), None, None, None, None, None, None


def tensor_step_pos_clique(state: JointState, act: Tensor, state_seq: JointState, mask_matrix, fd_matrix) -> JointState:
    p, v, a, j = CliqueTensorStep.apply(act, state.position, mask_matrix[0], mask_matrix[1], *fd_matrix[:3])
    state_seq.position, state_seq.velocity, state_seq.acceleration, state_seq.jerk = p, v, a, j
    return state_seq


# ---- the kernel classes: generated tensorstep kernels ------------------------------------------------

_STEPS: dict[tuple, Any] = {}


def _step(kind: str, u_act: Tensor, indexed: bool) -> Any:
    import tensorstep as ts

    dtype = {torch.float32: "float32", torch.float64: "float64"}.get(u_act.dtype)
    if dtype is None:
        raise TypeError(f"u_act: expected float32 or float64, got {u_act.dtype}")
    if u_act.dim() != 3:
        raise ValueError(f"u_act: expected [B, rows, dof], got shape {tuple(u_act.shape)}")
    rows, dof = u_act.shape[1], u_act.shape[2]
    horizon = rows + 4 if kind == "clique_central" else rows
    spec = LegacySpec(kind, horizon, dof, dtype, start_index=indexed)
    key = (spec, str(u_act.device))
    if key not in _STEPS:
        _STEPS[key] = ts.load(spec, u_act.device)
    return _STEPS[key]


def _fill(outs: tuple, buffers: tuple) -> tuple:
    """Also write results into cuRobo's out_* buffers when they fit (callers use the returns)."""
    with torch.no_grad():
        for out, buf in zip(outs, buffers):
            if isinstance(buf, Tensor) and buf.shape == out.shape and buf.dtype == out.dtype and not buf.requires_grad:
                buf.copy_(out)
    return outs


def _contiguous(*tensors):
    return [t.contiguous() for t in tensors]


#: tensorstep's argument names → cuRobo's, for error messages
CUROBO_NAMES = {"u": "u_act", "p0": "start_position", "v0": "start_velocity", "a0": "start_acceleration",
                "dt": "traj_dt", "start_index": "start_idx"}
_NAME = re.compile(r"\b(" + "|".join(sorted(CUROBO_NAMES, key=len, reverse=True)) + r")\b")


def _curobo_names(err: Exception) -> Exception:
    """The same error with cuRobo's argument names (start_position, traj_dt, start_idx, ...)."""
    renamed = type(err)(_NAME.sub(lambda m: CUROBO_NAMES[m.group(1)], str(err)))
    return renamed.with_traceback(err.__traceback__)


class _KernelClass(torch.autograd.Function):
    """cuRobo's kernel classes: ``Cls.apply(...)`` → (P, V, A, J), [B, H, n] each.

    A real ``torch.autograd.Function``: forward runs the generated tensorstep step; backward is
    the step's exact adjoint (through its own autograd), jvp its tangent. Under functorch
    transforms (vmap, grad, jacfwd) the call goes to the step directly, which supports them.
    """

    kind = ""
    indexed = False

    @classmethod
    def _dt(cls, traj_dt: Tensor, u_act: Tensor, horizon: int) -> Tensor:
        dt = traj_dt.to(device=u_act.device, dtype=u_act.dtype).reshape(-1)
        return dt[:1].contiguous() if cls.kind.startswith("clique") else dt[:horizon].contiguous()

    @classmethod
    def _call(cls, u_act, p, v, a, idx, traj_dt):
        """The step on contiguous inputs, with cuRobo's names in its errors."""
        step = _step(cls.kind, u_act, cls.indexed)
        u_act, p, v, a = _contiguous(u_act, p, v, a)
        kw = {"start_index": idx.to(torch.int64)} if cls.indexed else {}
        try:
            return step(u_act, p, v, a, cls._dt(traj_dt, u_act, step.spec.horizon), **kw)
        except (TypeError, ValueError, IndexError) as err:
            raise _curobo_names(err) from None

    @classmethod
    def _run(cls, u_act, p, v, a, idx, traj_dt, buffers):
        if torch._C._are_functorch_transforms_active():
            outs = cls._call(u_act, p, v, a, idx, traj_dt)
        else:
            outs = super().apply(u_act, p, v, a, idx, traj_dt)
        return _fill(outs, buffers)

    @classmethod
    def forward(cls, u_act, p, v, a, idx, traj_dt):  # type: ignore[override]
        return tuple(cls._call(u_act, p, v, a, idx, traj_dt))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.has_idx = inputs[4] is not None
        ctx.save_for_backward(*(t for t in inputs if t is not None))
        ctx.save_for_forward(*(t for t in inputs if t is not None))

    @staticmethod
    def _inputs(ctx) -> list:
        saved = list(ctx.saved_tensors)
        return saved if ctx.has_idx else saved[:4] + [None] + saved[4:]

    @classmethod
    def backward(cls, ctx, *grads):  # type: ignore[override]
        inputs = cls._inputs(ctx)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad) if need]
        create_graph = torch.is_grad_enabled()  # double backward; read before enable_grad turns it on
        with torch.enable_grad():  # the step's own (exact, generated) adjoint
            leaves = [t.detach().requires_grad_(i in wanted) if t is not None else None for i, t in enumerate(inputs)]
            got = torch.autograd.grad(cls._call(*leaves), [leaves[i] for i in wanted], grads, allow_unused=True,
                                      create_graph=create_graph)
        result: list[Optional[Tensor]] = [None] * len(inputs)
        for i, g in zip(wanted, got):
            result[i] = g if g is not None else torch.zeros_like(inputs[i])
        return tuple(result)

    @classmethod
    def jvp(cls, ctx, du, dp, dv, da, _didx, ddt):  # type: ignore[override]
        from ..runtime.autograd import DtJvpFunction

        u, p, v, a, idx, traj_dt = cls._inputs(ctx)
        du, dp, dv, da = (torch.zeros_like(x) if t is None else t for x, t in ((u, du), (p, dp), (v, dv), (a, da)))
        if ddt is None:  # linear in (u, start): the tangent is the step applied to the tangents
            return tuple(cls._call(du, dp, dv, da, idx, traj_dt))
        step = _step(cls.kind, u, cls.indexed)
        H = step.spec.horizon
        index = idx.to(torch.int64).contiguous() if idx is not None else None
        inputs = [*_contiguous(u, p, v, a), None, index]  # the step's table order (no j0)
        tangents = [*_contiguous(du, dp, dv, da), None]  # of its differentiable inputs
        return tuple(DtJvpFunction.apply(step.launcher, cls._dt(traj_dt, u, H), cls._dt(ddt, u, H).contiguous(),
                                         *inputs, *tangents))


class _Plain(_KernelClass):
    @classmethod
    def apply(cls, u_act, start_position, start_velocity, start_acceleration, out_position, out_velocity,
              out_acceleration, out_jerk, traj_dt, out_grad_position):
        return cls._run(u_act, start_position, start_velocity, start_acceleration, None, traj_dt,
                        (out_position, out_velocity, out_acceleration, out_jerk))


class _Indexed(_KernelClass):
    indexed = True

    @classmethod
    def apply(cls, u_act, start_position, start_velocity, start_acceleration, start_idx, out_position,
              out_velocity, out_acceleration, out_jerk, traj_dt, out_grad_position):
        return cls._run(u_act, start_position, start_velocity, start_acceleration, start_idx, traj_dt,
                        (out_position, out_velocity, out_acceleration, out_jerk))


class CliqueTensorStepKernel(_Plain):
    """Backward differences; traj_dt[0] is the inverse step duration."""
    kind = "clique_backward"


class CliqueTensorStepIdxKernel(_Indexed):
    """Backward differences with start rows picked by start_idx (works here; cuRobo aborts)."""
    kind = "clique_backward"


class CliqueTensorStepCoalesceKernel(_Plain):
    """Same results as CliqueTensorStepKernel (cuRobo's own version returns wrong values)."""
    kind = "clique_backward"


class CliqueTensorStepCentralDifferenceKernel(_Plain):
    """Five-point central differences; u_act has H-4 rows; exact gradient for the last action too."""
    kind = "clique_central"


class CliqueTensorStepIdxCentralDifferenceKernel(_Indexed):
    kind = "clique_central"


class AccelerationTensorStepKernel(_Plain):
    """cuRobo's default 'rk2' acceleration integration (half velocity increment kept); exact backward."""
    kind = "accel_rk2"


class AccelerationTensorStepIdxKernel(_Indexed):
    """Semi-implicit Euler acceleration integration with start_idx; exact backward."""
    kind = "accel_semi_euler"


__all__ = [
    "TensorDeviceType", "JointState",
    "build_fd_matrix", "build_int_matrix", "build_clique_matrix", "build_start_state_mask", "sum_matrix",
    "interpolate_kernel", "action_interpolate_kernel", "tensor_linspace",
    "euler_integrate", "tensor_step_acc", "tensor_step_jerk", "step_acc_semi_euler", "tensor_step_acc_semi_euler",
    "tensor_step_vel", "tensor_step_pos", "tensor_step_pos_ik", "jit_tensor_step_pos_clique",
    "jit_backward_pos_clique", "jit_tensor_step_pos_clique_contiguous", "jit_backward_pos_clique_contiguous",
    "CliqueTensorStep", "tensor_step_pos_clique",
    "CliqueTensorStepKernel", "CliqueTensorStepIdxKernel", "CliqueTensorStepCoalesceKernel",
    "CliqueTensorStepCentralDifferenceKernel", "CliqueTensorStepIdxCentralDifferenceKernel",
    "AccelerationTensorStepKernel", "AccelerationTensorStepIdxKernel",
]
