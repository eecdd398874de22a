"""tensorstep.compat.curobo_v2 against the independent NumPy reference (reference_curobo_v2.py).

Forward values for H ∈ {9, 12, 40} and B-spline steps s ∈ {1, 3, 4, 20}, degrees 3–5, goal flags
on, off and mixed per goal row; backward against the reference's dense Jacobians (exact for the
affine inputs, central differences for dt); gradcheck with forward mode; the checks named with
cuRobo's arguments; the CUDA source compiled by nvcc and run on the host.
"""
from __future__ import annotations

import inspect
import shutil

import numpy as np
import pytest
import torch

from tensorstep.codegen.legacy_spec import LegacySpec
from tensorstep.codegen.curobo_v2_spec import CuroboV2Spec
from tensorstep.compat import curobo_v2 as C

import reference_curobo_v2 as ref
from cuda_on_host import host_step
from helpers import check_ptx, gradcheck64, gradgradcheck64, scale_close

f64, f32 = torch.float64, torch.float32
FLAGS = {"on": [1, 1, 1], "off": [0, 0, 0], "mixed": [1, 0, 1]}
NS, NG = 4, 3  # start and goal table rows


class Case:
    """Random tables and indices for one call (float64 masters; ``t(x, dtype)`` converts)."""

    def __init__(self, B: int, rows: int, D: int, flags, seed: int = 0, dts=(0.05, 0.11, 0.08)):
        g = torch.Generator().manual_seed(seed)
        r = lambda *shape: torch.randn(*shape, generator=g, dtype=f64)
        self.B, self.D = B, D
        self.u = r(B, rows, D)
        self.start = [r(NS, D) for _ in range(4)]  # p, v, a, j
        self.goal = [r(NG, D) for _ in range(4)]
        self.sidx = torch.randint(0, NS, (B,), generator=g, dtype=torch.int32)
        self.gidx = torch.arange(B, dtype=torch.int32) % NG
        self.traj_dt = torch.tensor(dts, dtype=f64)
        self.flag = torch.tensor(flags, dtype=torch.uint8)

    def to(self, device: str) -> "Case":
        """The same case with every tensor on ``device``."""
        moved = object.__new__(Case)
        for k, v in vars(self).items():
            moved.__dict__[k] = [t.to(device) for t in v] if isinstance(v, list) else \
                v.to(device) if isinstance(v, torch.Tensor) else v
        return moved


def clique(case: Case, H: int, dtype=f64, **over):
    x = {"u": case.u, "sp": case.start[0], "sv": case.start[1], "sa": case.start[2], "gp": case.goal[0],
         "traj_dt": case.traj_dt, **over}
    t = {k: v.to(dtype) for k, v in x.items()}
    out = torch.empty(case.B, H, case.D, dtype=dtype, device=case.u.device)
    return C.CliqueTensorStepIdxKernel.apply(t["u"], t["sp"], t["sv"], t["sa"], t["gp"], case.goal[1].to(dtype),
                                             case.goal[2].to(dtype), case.sidx, case.gidx, out, None, None, None,
                                             None, t["traj_dt"], case.flag, None)


def clique_reference(case: Case, H: int, **over):
    x = {"u_act": case.u, "start_p": case.start[0], "start_v": case.start[1], "start_a": case.start[2],
         "goal_p": case.goal[0], "traj_dt": case.traj_dt, **over}
    return ref.clique_v2(**{k: np.asarray(v) for k, v in x.items()}, start_idx=case.sidx.numpy(),
                         goal_idx=case.gidx.numpy(), flag=case.flag.numpy(), H=H)[:4]


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("H", [9, 12, 40])
@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
def test_clique_forward_matches_reference(H, flags, dtype):
    case = Case(3, H - 4, 3, FLAGS[flags])
    out_dt = torch.empty(3, dtype=dtype)
    outs = [torch.empty(3, H, 3, dtype=dtype) for _ in range(4)]
    got = C.CliqueTensorStepIdxKernel.apply(
        case.u.to(dtype), *(x.to(dtype) for x in case.start[:3]), *(x.to(dtype) for x in case.goal[:3]), case.sidx,
        case.gidx, *outs, out_dt, case.traj_dt.to(dtype), case.flag, None)
    expected = clique_reference(case, H)
    tol = 1e-12 if dtype == f64 else 1e-5
    for k in range(4):
        scale_close(got[k].double().numpy(), expected[k], tol)
        assert torch.equal(outs[k], got[k])  # cuRobo's out_* buffers are written too
    assert torch.equal(out_dt, case.traj_dt.to(dtype)[case.gidx.long()])


def _backward(fn, inputs: dict, names, grads):
    leaves = {k: v.clone().requires_grad_(k in names) for k, v in inputs.items()}
    outs = fn(**leaves)
    got = torch.autograd.grad(outs, [leaves[k] for k in names], grads)
    return dict(zip(names, got))


def _vjp(jacobians, grads) -> np.ndarray:
    return sum(J.T @ g.numpy().reshape(-1) for J, g in zip(jacobians, grads))


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("H", [9, 12])
def test_clique_backward_is_the_dense_transpose(H, flags):
    case = Case(3, H - 4, 2, FLAGS[flags], seed=1)
    inputs = {"u": case.u, "sp": case.start[0], "sv": case.start[1], "sa": case.start[2], "gp": case.goal[0],
              "traj_dt": case.traj_dt}
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(3, H, 2, generator=g, dtype=f64) for _ in range(4)]
    got = _backward(lambda **x: clique(case, H, **x), inputs, list(inputs), grads)
    names = {"u": "u_act", "sp": "start_p", "sv": "start_v", "sa": "start_a", "gp": "goal_p", "traj_dt": "traj_dt"}
    fn = lambda **x: clique_reference(case, H, **x)
    arrays = {names[k]: v.numpy() for k, v in inputs.items()}
    for k, name in names.items():
        jac = (ref.central_difference_jacobian if k == "traj_dt" else ref.affine_jacobian)(fn, arrays, name)
        expected = _vjp(jac, grads).reshape(inputs[k].shape)
        scale_close(got[k].numpy(), expected, 1e-6 if k == "traj_dt" else 1e-12)
    if flags == "on":  # the held goal replaces the last action
        assert float(got["u"][:, -1].abs().max()) == 0.0


def acceleration(case: Case, H: int, traj_dt: torch.Tensor, dtype=f64, **over):
    x = {"u": case.u, "sp": case.start[0], "sv": case.start[1], "sa": case.start[2], "traj_dt": traj_dt, **over}
    t = {k: v.to(dtype) for k, v in x.items()}
    return C.AccelerationTensorStepIdxKernel.apply(t["u"], t["sp"], t["sv"], t["sa"], case.sidx,
                                                   torch.empty(case.B, H, case.D, dtype=dtype, device=case.u.device), None, None, None,
                                                   t["traj_dt"], None)


@pytest.mark.parametrize("H", [9, 12, 40])
def test_acceleration_forward_and_backward_match_reference(H):
    case = Case(3, H, 2, FLAGS["off"], seed=2)
    traj_dt = 0.02 + 0.05 * torch.rand(H + 3, generator=torch.Generator().manual_seed(2), dtype=f64)
    fn = lambda **x: ref.acceleration_v2(**x, start_idx=case.sidx.numpy(), H=H)
    arrays = {"u_act": case.u.numpy(), "start_p": case.start[0].numpy(), "start_v": case.start[1].numpy(),
              "start_a": case.start[2].numpy(), "traj_dt": traj_dt.numpy()}
    expected = fn(**arrays)
    for dtype, tol in ((f64, 1e-12), (f32, 1e-5)):
        got = acceleration(case, H, traj_dt, dtype)
        for k in range(4):
            scale_close(got[k].double().numpy(), expected[k], tol)
    if H == 40:
        return
    inputs = {"u": case.u, "sp": case.start[0], "sv": case.start[1], "sa": case.start[2], "traj_dt": traj_dt}
    grads = [torch.randn(3, H, 2, generator=torch.Generator().manual_seed(k), dtype=f64) for k in range(4)]
    got = _backward(lambda traj_dt, **x: acceleration(case, H, traj_dt, **x), inputs, list(inputs), grads)
    for k, name in zip(inputs, arrays):
        jac = (ref.central_difference_jacobian if k == "traj_dt" else ref.affine_jacobian)(fn, arrays, name)
        scale_close(got[k].numpy(), _vjp(jac, grads).reshape(inputs[k].shape), 1e-6 if k == "traj_dt" else 1e-12)
    assert float(got["u"][:, -1].abs().max()) == 0.0 and float(got["traj_dt"][0]) == 0.0  # never read


def bspline(case: Case, R: int, degree: int, dtype=f64, out_dt=None, **over):
    x = {"u": case.u, **{f"s{i}": t for i, t in enumerate(case.start)}, **{f"g{i}": t for i, t in enumerate(case.goal)},
         "traj_dt": case.traj_dt, **over}
    t = {k: v.to(dtype) for k, v in x.items()}
    return C.BSplineIdxKernel.apply(t["u"], t["s0"], t["s1"], t["s2"], t["s3"], t["g0"], t["g1"], t["g2"], t["g3"],
                                    case.sidx, case.gidx, torch.empty(case.B, R, case.D, dtype=dtype, device=case.u.device), None, None,
                                    None, out_dt, t["traj_dt"], case.flag, None, degree)


def bspline_reference(case: Case, R: int, degree: int, **over):
    x = {"u_act": case.u, **{f"start_{c}": t for c, t in zip("pvaj", case.start)},
         **{f"goal_{c}": t for c, t in zip("pvaj", case.goal)}, "traj_dt": case.traj_dt, **over}
    return ref.bspline_v2(**{k: np.asarray(v) for k, v in x.items()}, start_idx=case.sidx.numpy(),
                          goal_idx=case.gidx.numpy(), flag=case.flag.numpy(), R=R, degree=degree)[:4]


# s = 20 (above 16, not a power of two) once: its kernel is long straight-line code (R = 161 rows),
# shared with the backward test below
BSPLINE_CASES = [(d, s, n, extra) for d in (3, 4, 5) for s, n, extra in ((1, 7, 0), (3, 6, 2), (4, 8, 0))] \
    + [(3, 20, 5, 0)]


@pytest.mark.parametrize("degree, s, n, extra", BSPLINE_CASES, ids=[f"D{c[0]}-s{c[1]}-n{c[2]}" for c in BSPLINE_CASES])
def test_bspline_forward_matches_reference(degree, s, n, extra):
    """Mixed flags; R = T·s + 1 (+ extra rows, which hold the end state)."""
    case = Case(3, n, 2, FLAGS["mixed"], seed=degree + s)
    R = (n + degree + 1) * s + 1 + extra
    expected = bspline_reference(case, R, degree)
    out_dt = torch.empty(3, dtype=f64)
    for dtype, tol in ((f64, 1e-12), (f32, 1e-5))[: 2 if s == 3 else 1]:  # float32 once per degree
        got = bspline(case, R, degree, dtype, out_dt=out_dt.to(dtype))
        for k in range(4):
            scale_close(got[k].double().numpy(), expected[k], tol)
    bspline(case, R, degree, out_dt=out_dt)
    assert torch.equal(out_dt, case.traj_dt[case.gidx.long()])


@pytest.mark.parametrize("degree, s", [(3, 1), (4, 3), (5, 4), (3, 20)])
def test_bspline_backward_is_the_dense_transpose(degree, s):
    """Exact for every s (cuRobo's warp reduction is wrong for s ∉ {1, 2, 4, 8, 16}); to the knots,
    every start and goal table and traj_dt."""
    n = degree + 2
    case = Case(3, n, 2, FLAGS["mixed"], seed=11 * degree + s)
    R = (n + degree + 1) * s + 1
    inputs = {"u": case.u, **{f"s{i}": t for i, t in enumerate(case.start)},
              **{f"g{i}": t for i, t in enumerate(case.goal)}, "traj_dt": case.traj_dt}
    names = {"u": "u_act", **{f"s{i}": f"start_{c}" for i, c in enumerate("pvaj")},
             **{f"g{i}": f"goal_{c}" for i, c in enumerate("pvaj")}, "traj_dt": "traj_dt"}
    grads = [torch.randn(3, R, 2, generator=torch.Generator().manual_seed(k), dtype=f64) for k in range(4)]
    got = _backward(lambda **x: bspline(case, R, degree, **x), inputs, list(inputs), grads)
    fn = lambda **x: bspline_reference(case, R, degree, **x)
    arrays = {names[k]: v.numpy() for k, v in inputs.items()}
    for k, name in names.items():
        if k == "traj_dt":
            jac = ref.central_difference_jacobian(fn, arrays, name)
        else:
            # the map is linear in the knots and the tables together: with the others zero, each column
            # fn(e_k) − fn(0) is not the small difference of two large outputs (whose rounding, a few
            # 1e-12 of the scale, depends on the machine's NumPy)
            linear_only = {n: (a if n in (name, "traj_dt") else np.zeros_like(a)) for n, a in arrays.items()}
            jac = ref.affine_jacobian(fn, linear_only, name)
        scale_close(got[k].numpy(), _vjp(jac, grads).reshape(inputs[k].shape), 1e-6 if k == "traj_dt" else 1e-12)
    assert float(got["u"][0, -1].abs().max()) == 0.0  # flag set for trajectory 0: u_{n-1} unused
    if degree == 3:  # cuRobo drops the jerk term of the boundary points for degree 3
        assert float(got["s3"].abs().max()) == 0.0 and float(got["g3"].abs().max()) == 0.0


@pytest.mark.parametrize("degree", [3, 5])
def test_rows_held_past_the_spline_have_the_dense_adjoint(degree):
    """get_bspline_interpolation's kernels have more rows than the spline (max_out): the rows past
    it repeat the goal with the period s, so they form a loop over knots that reads no knot. The
    adjoint of such a kernel (generation failed on it once) is the dense operator's transpose."""
    import tensorstep as ts
    from tensorstep.codegen.builders import build_operator

    spec = CuroboV2Spec("bspline", 60, 2, "float64", degree, 6, 2)
    step = ts.load(spec)
    g = torch.Generator().manual_seed(degree)
    u = torch.randn(2, 6, 2, generator=g, dtype=f64, requires_grad=True)
    p0, v0, a0, j0, *goal = (torch.randn(2, 2, generator=g, dtype=f64) for _ in range(8))
    outs = step(u, p0, v0, a0, torch.full((2,), 0.1, dtype=f64), j0=j0, goal=tuple(goal), start_index=torch.arange(2))
    grads = [torch.randn(o.shape, generator=g, dtype=f64) for o in outs]
    (got,) = torch.autograd.grad(outs, u, grads)
    M_u, _, _ = build_operator(spec).dense([0.1])
    expected = sum(np.einsum("hn,bhd->bnd", M_u[k], grads[k].numpy()) for k in range(len(outs)))
    scale_close(got.numpy(), expected, 1e-12)


def test_gradcheck_with_forward_mode():
    """gradcheck (backward and forward AD) of all three kernel classes through every float input."""
    case = Case(2, 5, 2, [1, 0, 1], seed=3)
    gc = lambda f, xs: gradcheck64(f, [x.clone().requires_grad_(True) for x in xs], check_forward_ad=True)
    assert gc(lambda u, sp, sv, sa, gp, dt: clique(case, 9, u=u, sp=sp, sv=sv, sa=sa, gp=gp, traj_dt=dt),
              [case.u, *case.start[:3], case.goal[0], case.traj_dt])
    traj_dt = torch.tensor([0.1, 0.05, 0.07, 0.2, 0.11], dtype=f64)
    accel = Case(2, 5, 2, [0, 0, 0], seed=4)
    assert gc(lambda u, sp, sv, sa, dt: acceleration(accel, 5, dt, u=u, sp=sp, sv=sv, sa=sa),
              [accel.u, *accel.start[:3], traj_dt])
    knots = Case(2, 5, 2, [1, 0, 1], seed=5)
    names = ["u", "s0", "s1", "s2", "s3", "g0", "g1", "g2", "g3", "traj_dt"]
    values = [knots.u, *knots.start, *knots.goal, knots.traj_dt]
    assert gc(lambda *x: bspline(knots, 3 * 10 + 1, 4, **dict(zip(names, x))), values)


def test_double_backward_and_autograd_function():
    case = Case(2, 5, 2, [1, 0, 1], seed=6)
    for cls in (C.CliqueTensorStepIdxKernel, C.AccelerationTensorStepIdxKernel, C.BSplineIdxKernel):
        assert issubclass(cls, torch.autograd.Function)
    u = case.u.clone().requires_grad_(True)
    y = clique(case, 9, u=u)
    assert type(y[0].grad_fn).__name__ == "CliqueTensorStepIdxKernelBackward"
    assert gradgradcheck64(lambda u: clique(case, 9, u=u), [u])


def test_bspline_dt_floor_and_flag_off_tail():
    """kdt = max(dt, 1e-6)·s: a dt below the floor (even ≤ 0) gives the floored curve and no dt
    gradient; out_dt keeps the raw value. With the flag off the goal has no effect."""
    case = Case(3, 6, 2, FLAGS["off"], seed=7, dts=(-0.5, 0.0, 1e-7))
    R = 11 * 2 + 1
    traj_dt = case.traj_dt.clone().requires_grad_(True)
    out_dt = torch.empty(3, dtype=f64)
    got = bspline(case, R, 4, out_dt=out_dt, traj_dt=traj_dt)
    floored = bspline_reference(case, R, 4, traj_dt=np.full(3, 1e-6))
    for k in range(4):
        scale_close(got[k].detach().numpy(), floored[k], 1e-12)
    assert torch.equal(out_dt, case.traj_dt)
    (g,) = torch.autograd.grad(got[0].sum(), traj_dt)
    assert float(g.abs().max()) == 0.0
    moved = bspline(case, R, 4, **{f"g{i}": case.goal[i] + 1.0 for i in range(4)})
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, moved))


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_bspline_interpolation_matches_reference(degree):
    n, B, D, max_out = 6, 3, 2, 60
    case = Case(B, n, D, FLAGS["mixed"], seed=degree)
    T = n + degree + 1
    horizon = torch.tensor([T * 2 + 3, 100, T], dtype=torch.int32)  # s = 2, capped at max_out - 1, s = 1
    interp_dt = torch.tensor([0.03], dtype=f64)
    out = C.JointState(*(torch.empty(B, max_out, D, dtype=f64) for _ in range(4)), dt=torch.empty(B, dtype=f64))
    given = C.get_bspline_interpolation(
        C.JointState(knot=case.u, knot_dt=torch.tensor([0.1], dtype=f64)), out, interp_dt,
        C.JointState(*case.start), C.JointState(*case.goal), case.sidx, case.gidx, case.flag, horizon, degree)
    assert given is out
    expected = ref.bspline_interpolation_v2(case.u.numpy(), *(t.numpy() for t in case.start),
                                            *(t.numpy() for t in case.goal), case.sidx.numpy(), case.gidx.numpy(),
                                            interp_dt.numpy(), case.flag.numpy(), horizon.numpy(), max_out, degree)
    for k, name in enumerate(("position", "velocity", "acceleration", "jerk")):
        scale_close(getattr(out, name).numpy(), expected[k], 1e-12)
    assert torch.equal(out.dt, torch.full((B,), 0.03, dtype=f64))


def test_signatures_follow_curobo_v2_argument_order():
    params = lambda f: list(inspect.signature(f).parameters)
    assert params(C.CliqueTensorStepIdxKernel.apply) == [
        "u_act", "start_position", "start_velocity", "start_acceleration", "goal_position", "goal_velocity",
        "goal_acceleration", "start_idx", "goal_idx", "out_position", "out_velocity", "out_acceleration", "out_jerk",
        "out_dt", "traj_dt", "use_implicit_goal_state", "out_grad_position"]
    assert params(C.AccelerationTensorStepIdxKernel.apply) == [
        "u_act", "start_position", "start_velocity", "start_acceleration", "start_idx", "out_position",
        "out_velocity", "out_acceleration", "out_jerk", "traj_dt", "out_grad_position"]
    assert params(C.BSplineIdxKernel.apply) == [
        "u_act", "start_position", "start_velocity", "start_acceleration", "start_jerk", "goal_position",
        "goal_velocity", "goal_acceleration", "goal_jerk", "start_idx", "goal_idx", "out_position", "out_velocity",
        "out_acceleration", "out_jerk", "out_dt", "traj_dt", "use_implicit_goal_state", "out_grad_position",
        "bspline_degree", "use_flat_gradient"]
    assert params(C.get_bspline_interpolation) == [
        "input_trajectory", "output_trajectory", "interpolation_dt", "current_state", "goal_state", "start_idx",
        "goal_idx", "use_implicit_goal_state", "interpolated_horizon", "bspline_degree"]


# ---- bad input: clear errors with cuRobo's names, before any kernel runs ------------------------------

def _no_kernel(monkeypatch):
    """Fail the test if a generated step is called."""
    monkeypatch.setattr(C, "_step", lambda *a: pytest.fail("a kernel ran before the check"))


CLIQUE_ERRORS = [
    ({"u": torch.zeros(3, 6, 2, dtype=f64)}, ValueError, r"u_act: expected u_act.shape\[-2\] = H - 4 = 5"),
    ({"H": 8, "u": torch.zeros(3, 4, 2, dtype=f64)}, ValueError, r"out_position: H = 8 rows; .* H >= 9"),
    ({"sidx": torch.zeros(3, dtype=f64)}, TypeError, r"start_idx: expected dtype torch.int32 or torch.int64, got"),
    ({"gidx": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, r"goal_idx: expected shape \(3,\) or \(3, 1\)"),
    ({"gidx": torch.tensor([0, 1, 3], dtype=torch.int32)}, IndexError, r"goal_idx: entry 3 is out of range: .*goal_position"),
    ({"sidx": torch.tensor([0, 9, 1], dtype=torch.int32)}, IndexError, r"start_idx: entry 9 is out of range"),
    ({"traj_dt": torch.tensor([0.1, 0.1], dtype=f64)}, IndexError, r"goal_idx: entry 2 is out of range: .*traj_dt"),
    ({"flag": torch.tensor([1, 0], dtype=torch.uint8)}, IndexError, r"use_implicit_goal_state.*number 2"),
    ({"flag": torch.tensor([1, 0, 1], dtype=torch.int32)}, TypeError, r"use_implicit_goal_state: expected dtype torch.uint8"),
    ({"traj_dt": torch.tensor([0.1, -0.1, 0.1], dtype=f64)}, ValueError, r"traj_dt: expected finite, positive .*goal_idx\[1\]"),
    ({"traj_dt": torch.tensor([0.1, 0.1, 0.1], dtype=f32)}, TypeError, r"traj_dt: expected dtype torch.float64"),
    ({"sp": torch.zeros(NS, 3, dtype=f64)}, ValueError, r"start_position: expected shape \(\*, 2\)"),
    ({"sv": torch.zeros(NS + 1, 2, dtype=f64)}, ValueError, r"start_velocity: expected shape \(4, 2\)"),
    ({"gp": torch.zeros(NG, 2, dtype=f32)}, TypeError, r"goal_position: expected dtype torch.float64"),
    ({"gp": "goal"}, TypeError, r"goal_position: expected a torch.Tensor"),
    ({"u": torch.zeros(3, 5, 2, dtype=torch.float16)}, TypeError, r"u_act: expected dtype torch.float32 or torch.float64"),
    ({"out": None}, TypeError, r"out_position: expected a torch.Tensor"),
    ({"out_dt": torch.zeros(2, dtype=f64)}, ValueError, r"out_dt: expected at least B = 3 elements"),
    ({"out_dt": torch.zeros(4, 2, dtype=f64).t()}, ValueError, r"out_dt: expected a 1-D or contiguous tensor"),
    ({"u": torch.zeros(3, 5, 3, dtype=f64)}, ValueError, r"u_act: expected 2 dof \(the last dimension of out_position"),
    ({"out2": "out"}, ValueError, r"out_velocity: shares memory with out_position"),
    ({"u": torch.zeros(0, 5, 2, dtype=f64)}, ValueError, r"u_act: batch size is 0"),
]


@pytest.mark.parametrize("over, kind, pattern", CLIQUE_ERRORS, ids=[e[2][:40] for e in CLIQUE_ERRORS])
def test_clique_bad_input(over, kind, pattern, monkeypatch):
    H = over.pop("H", 9)
    case = Case(3, H - 4, 2, FLAGS["mixed"])
    x = {"u": case.u, "sp": case.start[0], "sv": case.start[1], "sa": case.start[2], "gp": case.goal[0],
         "sidx": case.sidx, "gidx": case.gidx, "traj_dt": case.traj_dt, "flag": case.flag,
         "out": torch.empty(3, H, 2, dtype=f64), "out2": None, "out_dt": None, **over}
    if x["out2"] == "out":
        x["out2"] = x["out"]
    _no_kernel(monkeypatch)
    with pytest.raises(kind, match=pattern) as info:
        C.CliqueTensorStepIdxKernel.apply(x["u"], x["sp"], x["sv"], x["sa"], x["gp"], None, None, x["sidx"], x["gidx"],
                                          x["out"], x["out2"], None, None, x["out_dt"], x["traj_dt"], x["flag"], None)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)  # cuRobo's callers catch ValueError


def test_acceleration_bad_input(monkeypatch):
    case = Case(2, 6, 2, FLAGS["off"])
    call = lambda **kw: C.AccelerationTensorStepIdxKernel.apply(
        kw.get("u", case.u), *case.start[:3], kw.get("sidx", case.sidx[:2]), torch.empty(2, 6, 2, dtype=f64),
        None, None, None, kw.get("traj_dt", torch.full((6,), 0.1, dtype=f64)), None)
    _no_kernel(monkeypatch)
    with pytest.raises(ValueError, match=r"u_act: expected u_act.shape\[-2\] = H = 6"):
        call(u=torch.zeros(2, 5, 2, dtype=f64))
    with pytest.raises(ValueError, match=r"traj_dt: expected at least H = 6 step durations"):
        call(traj_dt=torch.full((5,), 0.1, dtype=f64))
    with pytest.raises(ValueError, match=r"start_idx: expected dtype torch.int32 or torch.int64"):
        call(sidx=torch.zeros(2, dtype=f32))
    with pytest.raises(IndexError, match=r"start_idx: entry 4 is out of range"):
        call(sidx=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"u_act: expected 2 dof"):
        call(u=torch.zeros(2, 6, 3, dtype=f64))


def test_bspline_bad_input(monkeypatch):
    case = Case(3, 6, 2, FLAGS["mixed"])
    _no_kernel(monkeypatch)
    with pytest.raises(ValueError, match=r"bspline_degree: expected one of 3, 4, 5, got 6"):
        bspline(case, 40, 6)
    with pytest.raises(ValueError, match=r"out_position: 11 rows cannot hold 11 spans"):
        bspline(case, 11, 4)
    few = Case(3, 4, 2, FLAGS["mixed"])  # n = 4 = degree with the flag set: refused
    with pytest.raises(ValueError, match=r"u_act: 4 knots with bspline_degree=4 with use_implicit_goal_state set"):
        bspline(few, 40, 4)
    with pytest.raises(ValueError, match=r"u_act: 3 knots with bspline_degree=4: a span would be both"):
        bspline(Case(3, 3, 2, FLAGS["off"]), 40, 4)
    with pytest.raises(ValueError, match=r"traj_dt: expected finite step durations, got nan"):
        bspline(case, 40, 4, traj_dt=torch.tensor([0.1, float("nan"), 0.1], dtype=f64))
    with pytest.raises(ValueError, match=r"goal_jerk: expected shape \(3, 2\)"):
        bspline(case, 40, 4, g3=torch.zeros(2, 2, dtype=f64))
    with pytest.raises(ValueError, match=r"u_act: expected 2 dof"):
        bspline(case, 40, 4, u=torch.zeros(3, 6, 3, dtype=f64))
    with pytest.raises(IndexError, match=r"goal_idx: entry 2 is out of range") as info:
        bspline(case, 40, 4, traj_dt=case.traj_dt[:2])
    assert isinstance(info.value, ValueError)


def test_bspline_n_equal_degree_without_flag_is_computed():
    case = Case(3, 4, 2, FLAGS["off"], seed=8)
    R = 9 * 2 + 1
    got = bspline(case, R, 4)
    expected = bspline_reference(case, R, 4)
    for k in range(4):
        scale_close(got[k].numpy(), expected[k], 1e-12)


def test_interpolation_bad_input():
    B, n, D = 2, 6, 2
    case = Case(B, n, D, FLAGS["off"])
    out = C.JointState(*(torch.empty(B, 30, D, dtype=f64) for _ in range(4)), dt=torch.empty(B, dtype=f64))
    call = lambda horizon, knots=C.JointState(knot=case.u): C.get_bspline_interpolation(
        knots, out, torch.tensor([0.02], dtype=f64), C.JointState(*case.start), C.JointState(*case.goal),
        case.sidx[:B], case.gidx[:B], case.flag, torch.tensor(horizon, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"interpolated_horizon: entry 5 \(trajectory 1\) leaves fewer rows"):
        call([22, 5])
    with pytest.raises(TypeError, match=r"input_trajectory: expected an object with .knot"):
        call([22, 22], knots=object())


# ---- specs, generated sources, CUDA --------------------------------------------------------------

def test_spec_refuses_what_the_kernels_cannot_do():
    with pytest.raises(ValueError, match=r"CuroboV2Spec.horizon=8 is invalid"):
        CuroboV2Spec("clique", 8, 2)
    with pytest.raises(ValueError, match=r"CuroboV2Spec.degree=6 is invalid"):
        CuroboV2Spec("bspline", 100, 2, degree=6, knots=8, steps=2)
    with pytest.raises(ValueError, match=r"CuroboV2Spec.horizon=20 is invalid: 13 spans of 2 rows need at least 27"):
        CuroboV2Spec("bspline", 20, 2, degree=4, knots=8, steps=2)
    spec = CuroboV2Spec("bspline", 27, 2, degree=4, knots=8, steps=2)
    assert CuroboV2Spec.from_dict(spec.to_dict()) == spec and spec.n_actions == 8


HOST_SPECS = [CuroboV2Spec("clique", 10, 3, "float64"), CuroboV2Spec("bspline", 2 * 10 + 3, 3, "float64", 4, 5, 2),
              CuroboV2Spec("bspline", 3 * 9 + 1, 2, "float32", 3, 5, 3),
              LegacySpec("accel_semi_euler", 9, 2, "float64", start_index=True)]


@pytest.mark.parametrize("spec", HOST_SPECS, ids=lambda s: s.name)
def test_cuda_source_run_on_the_host_matches_reference(spec, monkeypatch):
    """The generated CUDA kernels run on the host (every thread of the grid in turn) behind the
    kernel classes: forward against the reference, gradcheck with forward mode (float64)."""
    step = host_step(spec)
    monkeypatch.setitem(C._STEPS, (spec, "cpu"), step)  # the classes' loaded steps
    dtype = f64 if spec.dtype == "float64" else f32
    small = Case(2, spec.n_actions, spec.dof, [1, 0, 1], seed=10)
    x = [small.u, small.start[0], small.goal[0], small.traj_dt]
    case = Case(3, spec.n_actions, spec.dof, FLAGS["mixed"], seed=9)
    if isinstance(spec, LegacySpec):
        traj_dt = torch.linspace(0.05, 0.1, spec.horizon, dtype=f64)
        got = acceleration(case, spec.horizon, traj_dt, dtype)
        expected = ref.acceleration_v2(case.u.numpy(), *(t.numpy() for t in case.start[:3]), case.sidx.numpy(),
                                       traj_dt.numpy(), spec.horizon)
        x = [small.u, small.start[0], small.start[1], traj_dt]
        f = lambda u, sp, sv, dt: acceleration(small, spec.horizon, dt, u=u, sp=sp, sv=sv)
    elif spec.kind == "clique":
        got, expected = clique(case, spec.horizon, dtype), clique_reference(case, spec.horizon)
        f = lambda u, sp, gp, dt: clique(small, spec.horizon, u=u, sp=sp, gp=gp, traj_dt=dt)
    else:
        got = bspline(case, spec.horizon, spec.degree, dtype)
        expected = bspline_reference(case, spec.horizon, spec.degree)
        f = lambda u, sp, gp, dt: bspline(small, spec.horizon, spec.degree, u=u, s0=sp, g0=gp, traj_dt=dt)
    for k in range(4):
        scale_close(got[k].double().numpy(), expected[k], 1e-12 if dtype == f64 else 1e-5)
    if dtype == f64:
        assert gradcheck64(f, [t.clone().requires_grad_(True) for t in x], check_forward_ad=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_to_ptx(tmp_path):
    import tensorstep as ts

    specs = HOST_SPECS + [CuroboV2Spec("clique", 12, 7, "float32")]
    sources = [ts.source(spec, "cuda") for spec in specs]
    check_ptx(sources, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [f32, f64], ids=["f32", "f64"])
def test_cuda_matches_reference(dtype):
    """The three kernel classes on the GPU: forward against the reference, backward against the CPU."""
    tol = 1e-5 if dtype == f32 else 1e-12
    case, knots = Case(3, 8, 2, FLAGS["mixed"], seed=12), Case(3, 6, 2, FLAGS["mixed"], seed=13)
    traj_dt = torch.tensor([0.05, 0.1, 0.07, 0.02, 0.04, 0.06, 0.08, 0.09, 0.1, 0.11, 0.12, 0.13], dtype=f64)
    R = 11 * 3 + 1
    runs = [(lambda c, **kw: clique(c, 12, dtype, **kw), clique_reference(case, 12), case),
            (lambda c, **kw: acceleration(c, 8, traj_dt.to(c.u.device), dtype, **kw),
             ref.acceleration_v2(case.u.numpy(), *(t.numpy() for t in case.start[:3]), case.sidx.numpy(),
                                 traj_dt.numpy(), 8), case),
            (lambda c, **kw: bspline(c, R, 4, dtype, **kw), bspline_reference(knots, R, 4), knots)]
    for run, expected, c in runs:
        gpu = c.to("cuda")
        u = gpu.u.clone().requires_grad_(True)
        got = run(gpu, u=u)
        for k in range(4):
            scale_close(got[k].detach().double().cpu().numpy(), expected[k], tol)
        grads = [torch.randn_like(y) for y in got]
        (gu,) = torch.autograd.grad(got, [u], grads)
        u_cpu = c.u.clone().requires_grad_(True)
        (gu_cpu,) = torch.autograd.grad(run(c, u=u_cpu), [u_cpu], [g.cpu() for g in grads])
        scale_close(gu.double().cpu().numpy(), gu_cpu.double().numpy(), 10 * tol)


# ---- cuRobo v2 task files ------------------------------------------------------------------------

def test_curobo_v2_task_files_select_the_compat_kernels(tmp_path):
    """BSPLINE_4 with n_knots/interpolation_steps, POSITION with curobo_version: 2 (v0.7 files keep
    their native kernels); generate, list, check (the directory) and show take them."""
    from pathlib import Path

    from click.testing import CliRunner

    from tensorstep.cli import main
    from tensorstep.codegen.legacy_spec import LegacySpec
    from tensorstep.config import load_config

    data = Path(__file__).parents[1] / "data"
    robot = data / "curobo_franka.yml"
    (spline,) = load_config(robot, data / "curobo_v2_task_bspline.yml").specs
    assert spline == CuroboV2Spec("bspline", 13 * 4 + 1, 7, degree=4, knots=8, steps=4)
    (position,) = load_config(robot, data / "curobo_v2_task_position.yml").specs
    assert position == CuroboV2Spec("clique", 32, 7)
    accel = tmp_path / "accel.yml"
    accel.write_text("model:\n  curobo_version: 2\n  horizon: 12\n  control_space: ACCELERATION\n")
    assert load_config(robot, accel).specs == (LegacySpec("accel_semi_euler", 12, 7, start_index=True),)
    (v07,) = load_config(robot, data / "curobo_task.yml").specs
    assert type(v07).__name__ == "KernelSpec" and v07.horizon == 30
    invoke = lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    out = tmp_path / "gen"
    assert invoke("generate", robot, "--task", data / "curobo_v2_task_bspline.yml", "-o", out).exit_code == 0
    listed = invoke("list", out)
    assert listed.exit_code == 0 and "curobo_v2    bspline" in listed.output, listed.output
    checked = invoke("check", out)
    assert checked.exit_code == 0 and "all passed" in checked.output, checked.output
    shown = invoke("show", robot, "--task", data / "curobo_v2_task_position.yml", "--kernel", "forward")
    assert shown.exit_code == 0 and "void ts_curobo2_clique_h32_d7_f32_forward(" in shown.output


@pytest.mark.parametrize("model, pattern", [
    ("control_space: BSPLINE_6\n  curobo_version: 2\n  horizon: 20", r"'BSPLINE_6' is not supported: allowed POSITION, ACCELERATION, BSPLINE_3, BSPLINE_4, BSPLINE_5"),
    ("control_space: BSPLINE_4\n  interpolation_steps: 4", r"model.n_knots: missing key"),
    ("control_space: BSPLINE_4\n  n_knots: 0\n  interpolation_steps: 4", r"model.n_knots: expected an integer >= 1"),
    ("control_space: BSPLINE_4\n  n_knots: 8\n  interpolation_steps: 4\n  horizon: 40",
     r"model.horizon: 40 rows do not give 4 rows per span for 13 spans"),
    ("control_space: BSPLINE_4\n  n_knots: 2\n  interpolation_steps: 4", r"CuroboV2Spec.knots=2 is invalid"),
    ("control_space: POSITION\n  curobo_version: 2\n  horizon: 8", r"CuroboV2Spec.horizon=8 is invalid"),
    ("control_space: POSITION\n  curobo_version: 2\n  horizon: 20\n  state_finite_difference_mode: BACKWARD",
     r"five-point central"),
    ("control_space: POSITION\n  curobo_version: 3\n  horizon: 20", r"model.curobo_version: 3 is not supported"),
])
def test_curobo_v2_task_file_errors(tmp_path, model, pattern):
    from pathlib import Path

    from tensorstep.config import ConfigError, load_config

    task = tmp_path / "task.yml"
    task.write_text(f"model:\n  {model}\n")
    with pytest.raises(ConfigError, match=pattern):
        load_config(Path(__file__).parents[1] / "data" / "curobo_franka.yml", task)


def test_vmap_and_jacfwd():
    """Under functorch transforms the classes run the step directly (it carries the vmap rules)."""
    from torch.func import jacfwd, jacrev, vmap

    case = Case(3, 5, 2, FLAGS["mixed"], seed=14)
    us = torch.randn(4, 3, 5, 2, generator=torch.Generator().manual_seed(1), dtype=f64)
    got = vmap(lambda u: clique(case, 9, u=u))(us)
    for v in range(4):
        assert all(torch.equal(a[v], b) for a, b in zip(got, clique(case, 9, u=us[v])))
    knots = Case(2, 6, 2, FLAGS["mixed"], seed=15)
    forward = jacfwd(lambda u: bspline(knots, 23, 4, u=u)[2])(knots.u)
    reverse = jacrev(lambda u: bspline(knots, 23, 4, u=u)[2])(knots.u)
    torch.testing.assert_close(forward, reverse, rtol=1e-12, atol=1e-12)


# ---- the calls cuRobo v2's own code makes --------------------------------------------------------

def _flat_tables(case: Case) -> Case:
    """The same case, every start and goal table reshaped [2, rows/2, dof] or [1, rows, dof] (as
    cuRobo passes seed_goal_js [batch, seeds, dof]) and every index [B, 1] int64."""
    moved = object.__new__(Case)
    moved.__dict__.update(vars(case))
    moved.start = [t.reshape(2, -1, case.D) for t in case.start]  # NS = 4 rows
    moved.goal = [t.reshape(1, -1, case.D) for t in case.goal]
    moved.sidx, moved.gidx = case.sidx.long().reshape(-1, 1), case.gidx.long().reshape(-1, 1)
    return moved


def test_tables_of_more_dims_and_column_indices_as_curobo_passes_them():
    """[batch, seeds, dof] / [1, H, dof] tables read as flat rows of dof, [B, 1] int64 indices, in all
    three kernels: the values of the flat-table reference, gradients in the tables' own shapes."""
    case = Case(3, 5, 2, FLAGS["mixed"], seed=20)
    curobo = _flat_tables(case)
    for k, (got, expected) in enumerate(zip(clique(curobo, 9), clique_reference(case, 9))):
        scale_close(got.numpy(), expected, 1e-12)
    traj_dt = torch.linspace(0.05, 0.1, 12, dtype=f64)
    got = acceleration(curobo, 5, traj_dt)
    expected = ref.acceleration_v2(case.u.numpy(), *(t.numpy() for t in case.start[:3]), case.sidx.numpy(),
                                   traj_dt.numpy(), 5)
    for k in range(4):
        scale_close(got[k].numpy(), expected[k], 1e-12)
    knots = Case(3, 6, 2, FLAGS["mixed"], seed=21)
    R = 11 * 2 + 1
    for got, expected in zip(bspline(_flat_tables(knots), R, 4), bspline_reference(knots, R, 4)):
        scale_close(got.numpy(), expected, 1e-12)
    goal = curobo.goal[0].clone().requires_grad_(True)
    (g3,) = torch.autograd.grad(clique(curobo, 9, gp=goal)[0].sum(), goal)
    flat = case.goal[0].clone().requires_grad_(True)
    (g2,) = torch.autograd.grad(clique(case, 9, gp=flat)[0].sum(), flat)
    assert g3.shape == goal.shape and torch.equal(g3.reshape(g2.shape), g2) and float(g2.abs().max()) > 0


def test_interpolation_takes_curobo_tables_and_indices():
    n, B, D, max_out, degree = 6, 3, 2, 40, 4
    case = Case(B, n, D, FLAGS["mixed"], seed=22)
    curobo = _flat_tables(case)
    horizon = torch.tensor([[25], [39], [11]], dtype=torch.int64)  # [B, 1], as the goal registry's
    interp_dt = torch.tensor([0.03], dtype=f64)
    out = C.JointState(*(torch.empty(B, max_out, D, dtype=f64) for _ in range(4)), dt=torch.full((B + 2,), -1.0, dtype=f64))
    C.get_bspline_interpolation(C.JointState(knot=case.u), out, interp_dt, C.JointState(*curobo.start),
                                C.JointState(*curobo.goal), curobo.sidx, curobo.gidx, case.flag, horizon, degree)
    expected = ref.bspline_interpolation_v2(case.u.numpy(), *(t.numpy() for t in case.start),
                                            *(t.numpy() for t in case.goal), case.sidx.numpy(), case.gidx.numpy(),
                                            interp_dt.numpy(), case.flag.numpy(), horizon.reshape(-1).numpy(),
                                            max_out, degree)
    for k, name in enumerate(("position", "velocity", "acceleration", "jerk")):
        scale_close(getattr(out, name).numpy(), expected[k], 1e-12)
    assert out.dt.tolist() == [0.03] * B + [-1.0, -1.0]  # a longer dt buffer: its first B entries


@pytest.mark.parametrize("shape", [(5,), (5, 1), (1, 5)])
def test_out_dt_with_more_entries_gets_its_first_B_written(shape):
    case = Case(3, 5, 2, FLAGS["mixed"], seed=23)
    out_dt = torch.full(shape, -1.0, dtype=f32)
    C.CliqueTensorStepIdxKernel.apply(case.u, *case.start[:3], *case.goal[:3], case.sidx, case.gidx,
                                      torch.empty(3, 9, 2, dtype=f64), None, None, None, out_dt, case.traj_dt,
                                      case.flag, None)
    expected = case.traj_dt[case.gidx.long()].float().tolist() + [-1.0, -1.0]
    assert out_dt.reshape(-1).tolist() == expected
    out_dt = torch.full(shape, -1.0, dtype=f64)
    bspline(Case(3, 6, 2, FLAGS["mixed"], seed=23), 23, 4, out_dt=out_dt)
    assert out_dt.reshape(-1).tolist() == case.traj_dt[case.gidx.long()].tolist() + [-1.0, -1.0]


def _recording_steps(monkeypatch) -> list:
    """Record the out= of every step call the classes make (the kernel's own output tensors)."""
    calls = []
    load = C._step

    class Recording:
        def __init__(self, step):
            self.step, self.launcher = step, step.launcher

        def __call__(self, *args, out=None, **kw):
            calls.append(out)
            return self.step(*args, out=out, **kw)

    monkeypatch.setattr(C, "_step", lambda spec, device: Recording(load(spec, device)))
    return calls


KERNELS = ["clique", "acceleration", "bspline"]


def _call_with_buffers(kind: str, case: Case, leaves: dict, buffers: list):
    if kind == "clique":
        return C.CliqueTensorStepIdxKernel.apply(leaves["u"], leaves["sp"], leaves["sv"], leaves["sa"], leaves["gp"],
                                                 None, None, case.sidx, case.gidx, *buffers, None, leaves["traj_dt"],
                                                 case.flag, None)
    if kind == "acceleration":
        return C.AccelerationTensorStepIdxKernel.apply(leaves["u"], leaves["sp"], leaves["sv"], leaves["sa"],
                                                       case.sidx, *buffers, leaves["traj_dt"], None)
    return C.BSplineIdxKernel.apply(leaves["u"], leaves["sp"], leaves["sv"], leaves["sa"], None, leaves["gp"],
                                    case.goal[1], case.goal[2], None, case.sidx, case.gidx, *buffers, None,
                                    leaves["traj_dt"], case.flag, None, 4)


def _buffer_case(kind: str):
    """(case, rows, inputs, the reference as a function of the inputs' arrays, reference names)."""
    case = Case(3, {"clique": 6, "acceleration": 7, "bspline": 6}[kind], 2, FLAGS["mixed"], seed=24)
    inputs = {"u": case.u, "sp": case.start[0], "sv": case.start[1], "sa": case.start[2]}
    names = {"u": "u_act", "sp": "start_p", "sv": "start_v", "sa": "start_a", "traj_dt": "traj_dt"}
    if kind == "clique":
        rows, fn = 10, lambda **x: ref.clique_v2(**x, start_idx=case.sidx.numpy(), goal_idx=case.gidx.numpy(),
                                                 flag=case.flag.numpy(), H=10)[:4]
        inputs.update(gp=case.goal[0], traj_dt=case.traj_dt)
        names["gp"] = "goal_p"
    elif kind == "acceleration":
        rows = 7
        fn = lambda **x: ref.acceleration_v2(**x, start_idx=case.sidx.numpy(), H=7)
        inputs["traj_dt"] = torch.linspace(0.05, 0.1, 7, dtype=f64)
    else:
        rows = 11 * 2 + 1
        z = np.zeros((NS, 2))
        fn = lambda **x: ref.bspline_v2(**x, start_j=z, goal_v=case.goal[1].numpy(), goal_a=case.goal[2].numpy(),
                                        goal_j=z[:NG], start_idx=case.sidx.numpy(), goal_idx=case.gidx.numpy(),
                                        flag=case.flag.numpy(), R=rows, degree=4)[:4]
        inputs.update(gp=case.goal[0], traj_dt=case.traj_dt)
        names["gp"] = "goal_p"
    return case, rows, inputs, fn, names


@pytest.mark.parametrize("kind", KERNELS)
def test_returned_tensors_are_the_buffers_written_in_place_with_exact_gradients(kind, monkeypatch):
    """cuRobo returns its out_* buffers: the results share their memory (the kernel writes into them,
    no other output is allocated), the buffers stay plain tensors, and backward still reaches u,
    the start and goal tables and traj_dt with the reference's dense transposes. A second call
    into the same buffers (cuRobo's optimisation loop) works the same."""
    calls = _recording_steps(monkeypatch)
    case, rows, inputs, fn, names = _buffer_case(kind)
    buffers = [torch.empty(3, rows, 2, dtype=f64) for _ in range(4)]
    g = torch.Generator().manual_seed(25)
    grads = [torch.randn(3, rows, 2, generator=g, dtype=f64) for _ in range(4)]
    arrays = {names[k]: v.numpy() for k, v in inputs.items()}
    expected = fn(**arrays)
    for _ in range(2):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        got = _call_with_buffers(kind, case, leaves, buffers)
        assert [y is b for y, b in zip(calls[-1], buffers)] == [True] * 4  # the kernel wrote into the buffers
        for y, b, e in zip(got, buffers, expected):
            assert y.data_ptr() == b.data_ptr() and y.shape == b.shape and y.grad_fn is not None
            scale_close(b.numpy(), e, 1e-12)
        assert all(b.is_leaf and not b.requires_grad for b in buffers)
        got_grads = dict(zip(leaves, torch.autograd.grad(got, list(leaves.values()), grads)))
        for k, name in names.items():
            if k not in inputs:
                continue
            jac = (ref.central_difference_jacobian if k == "traj_dt" else ref.affine_jacobian)(fn, arrays, name)
            scale_close(got_grads[k].numpy(), _vjp(jac, grads).reshape(inputs[k].shape),
                        1e-6 if k == "traj_dt" else 1e-12)


def test_strided_and_missing_buffers():
    """A strided buffer (a slice of a larger one) is written through a copy and still returned; a
    missing one (None) gives a new tensor."""
    case = Case(3, 5, 2, FLAGS["mixed"], seed=26)
    big = torch.zeros(3, 9, 4, dtype=f64)
    position = big[..., 1:3]
    got = C.CliqueTensorStepIdxKernel.apply(case.u, *case.start[:3], *case.goal[:3], case.sidx, case.gidx, position,
                                            None, None, None, None, case.traj_dt, case.flag, None)
    expected = clique_reference(case, 9)
    assert got[0].data_ptr() == position.data_ptr() and float(big[..., 0].abs().max()) == 0.0
    for y, e in zip(got, expected):
        scale_close(y.numpy(), e, 1e-12)


def test_errors_are_value_errors_and_an_index_outside_its_table_stays_an_error():
    """cuRobo's callers catch ValueError: each kind of bad argument is one, and still the TypeError or
    IndexError PyTorch's conventions give."""
    case = Case(3, 5, 2, FLAGS["mixed"], seed=27)
    out = torch.empty(3, 9, 2, dtype=f64)
    call = lambda **kw: C.CliqueTensorStepIdxKernel.apply(
        kw.get("u", case.u), *case.start[:3], *case.goal[:3], kw.get("sidx", case.sidx), case.gidx, out, None, None,
        None, None, case.traj_dt, case.flag, None)
    for kw, also in (({"u": case.u.float()}, TypeError), ({"u": case.u[:, :4]}, TypeError),
                     ({"sidx": torch.tensor([[0], [4], [1]])}, IndexError),
                     ({"sidx": torch.tensor([0, -1, 1])}, IndexError)):
        with pytest.raises(ValueError) as info:
            call(**kw)
        assert isinstance(info.value, also) and isinstance(info.value, C.ArgumentError), info.value
    assert issubclass(C.IndexOutOfRange, IndexError) and issubclass(C.ArgumentError, (TypeError, ValueError))


@pytest.mark.parametrize("s", [3, 5, 4])
def test_float64_against_curobos_float32_row_parameter(s, monkeypatch):
    """cuRobo computes a row's t in float32, t = float(h)/float(s) − j. tensorstep's float64 kernel
    uses the exact t = (h mod s)/s: it equals a float64 transcription of cuRobo's kernel to ~1e-7
    of the output's scale when s is not a power of two, and to 1e-12 when it is."""
    case = Case(3, 6, 2, FLAGS["mixed"], seed=28)
    R = 11 * s + 1
    got = bspline(case, R, 4)

    def float32_row(h: int, steps: int, T: int):
        j = h // steps
        if j >= T:
            return T - 1, 1.0
        return j, float(np.float32(np.float32(h) / np.float32(steps)) - np.float32(j))

    monkeypatch.setattr(ref, "bspline_row", float32_row)
    faithful = bspline_reference(case, R, 4)
    errors = []
    for y, e in zip(got, faithful):
        scale = max(1.0, float(np.abs(e).max()))
        errors.append(float(np.abs(y.numpy() - e).max()) / scale)
    if s & (s - 1):
        assert 1e-12 < max(errors) < 1e-6, errors
    else:
        assert max(errors) < 1e-12, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", KERNELS)
def test_cuda_graph_capture_writes_the_buffers(kind):
    """Under CUDA-graph capture (as cuRobo runs its solvers) the captured call writes its out_*
    buffers; a replay with new actions leaves the reference's values in them."""
    case, rows, inputs, fn, names = _buffer_case(kind)
    gpu = case.to("cuda")
    static = {k: v.to("cuda") for k, v in inputs.items()}
    buffers = [torch.empty(3, rows, 2, dtype=f64, device="cuda") for _ in range(4)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: load the kernels outside the capture
            _call_with_buffers(kind, gpu, static, buffers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _call_with_buffers(kind, gpu, static, buffers)
    assert all(y.data_ptr() == b.data_ptr() for y, b in zip(got, buffers))
    u = torch.randn(inputs["u"].shape, generator=torch.Generator().manual_seed(29), dtype=f64)
    static["u"].copy_(u)
    graph.replay()
    torch.cuda.synchronize()
    expected = fn(**{names[k]: (u if k == "u" else v).numpy() for k, v in inputs.items()})
    for b, e in zip(buffers, expected):
        scale_close(b.cpu().numpy(), e, 1e-12)
