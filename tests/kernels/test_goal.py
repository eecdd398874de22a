"""end="goal" and dt="per_trajectory" (docs/semantics.md, goal state and step durations): against the independent float64 reference
(tests/reference.py: Vandermonde weights by exact rational solves), exact cubics, separate
uniform calls, gathered goals, finite differences, the CUDA source run on the host, nvcc,
torch.compile, and the argument checks."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

import reference
import tensorstep as ts
from helpers import ReferenceCase, check_ptx, scale_close

H, D = 8, 2
GOAL_GRID = [
    dict(end="goal"),
    dict(end="goal", difference="backward", accuracy=2),
    dict(end="goal", accuracy=(2, 4, 2), dt="per_step"),
    dict(end="goal", goal_index=True, start_index=True, layout="bdh"),
    dict(end="goal", order=4),
    dict(end="goal", dt="per_trajectory", goal_index=True),
    dict(dt="per_trajectory"),
    dict(dt="per_trajectory", control="acceleration", integrator="exact", start_index=True),
]


def grid_id(overrides: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in overrides.items())


def spec_of(overrides: dict, dtype: str = "float64") -> ts.KernelSpec:
    return ts.KernelSpec(horizon=H, dof=D, dtype=dtype, **overrides)


Case = ReferenceCase  # random inputs and the reference's outputs for them


# ---- spec ---------------------------------------------------------------------------------------

def test_spec_fields_and_names():
    assert ts.KernelSpec(horizon=6, dof=2).name == "ts_h6_d2_pos_cen_a442_hold_dtu_noidx_bhd_f32_o3"
    assert "goal_index" not in ts.KernelSpec(horizon=6, dof=2).to_dict()  # existing keys and banners unchanged
    spec = ts.KernelSpec(horizon=6, dof=2, end="goal", goal_index=True, dt="per_trajectory")
    assert spec.name == "ts_h6_d2_pos_cen_a442_goal_dtb_noidx_bhd_f32_o3_gidx"
    assert ts.KernelSpec.from_dict(spec.to_dict()) == spec and spec.n_actions == 4 and spec.n_dt == 1
    with pytest.raises(ValueError, match=r"KernelSpec.end='goal' is invalid: .*control='position'.*'hold', 'one_sided'"):
        ts.KernelSpec(horizon=6, dof=2, control="acceleration", end="goal")
    with pytest.raises(ValueError, match=r"KernelSpec.goal_index=True is invalid: .*end='goal'"):
        ts.KernelSpec(horizon=6, dof=2, goal_index=True)
    with pytest.raises(ValueError, match="KernelSpec.dt='per_trajectry' is invalid: allowed.*'per_trajectory'"):
        ts.KernelSpec(horizon=6, dof=2, dt="per_trajectry")


def test_argument_table_rows():
    from tensorstep.codegen.arguments import table

    t = table(ts.KernelSpec(horizon=6, dof=2, end="goal", goal_index=True, dt="per_trajectory"))
    assert t.family == "step_goal"
    assert [a.name for a in t.inputs] == ["u", "p0", "v0", "a0", "j0", "start_index", "gp", "gv", "ga", "gj",
                                          "goal_index", "dt"]
    assert t.input("gp").shape == ("G", "D") and t.input("gp").index == "goal_index"
    assert t.input("gj").presence == "optional" and t.dt.shape == ("B",)
    plain = table(ts.KernelSpec(horizon=6, dof=2, end="goal"))
    assert plain.input("gv").shape == ("B", "D") and plain.input("goal_index").presence == "absent"
    assert plain.schema() == t.schema()  # one op schema per family
    assert table(ts.KernelSpec(horizon=6, dof=2)).family == "step"


# ---- operator against the independent reference --------------------------------------------------

@pytest.mark.parametrize("overrides", GOAL_GRID, ids=[grid_id(g) for g in GOAL_GRID])
def test_operator_matrices_match_reference(overrides):
    spec = spec_of(overrides)
    dt = (0.05 + 0.1 * np.random.default_rng(1).random(H)).tolist() if spec.dt == "per_step" else 0.1
    got = ts.operator_matrices(spec, dt)
    M_u, M_s = reference.matrices(spec, dt)
    scale_close(got["u"], M_u, 1e-12)
    scale_close(got["start"], M_s, 1e-12)
    if spec.end == "goal":
        scale_close(got["goal"], reference.goal_matrix(spec, dt), 1e-12)
    else:
        assert "goal" not in got


@pytest.mark.parametrize("dt_mode", ["uniform", "per_step", "per_trajectory"])
def test_cubic_with_its_true_states_is_exact_at_every_row(dt_mode):
    """The central default (exact on cubics) given a cubic's true start and goal states: exact
    V, A, J at every row, and row H-1 is the goal state as given (the C kernel, float64)."""
    spec = ts.KernelSpec(horizon=H, dof=1, end="goal", dt=dt_mode, dtype="float64")
    c = [0.3, -1.2, 0.7, 2.1]
    derivative = lambda t, k: sum(c[i] * math.factorial(i) / math.factorial(i - k) * t ** (i - k)
                                  for i in range(k, 4))
    steps = 0.05 + 0.1 * np.random.default_rng(2).random(H) if dt_mode == "per_step" else np.full(H, 0.1)
    times = np.concatenate([[0.0], np.cumsum(steps[1:])])
    state = lambda t: torch.tensor([[[derivative(t, k)]] for k in range(4)], dtype=torch.float64)  # 4 x [B=1, D=1]
    u = torch.tensor([[[derivative(t, 0)] for t in times[1:-1]]], dtype=torch.float64)
    dt = {"uniform": 0.1, "per_step": torch.tensor(steps), "per_trajectory": torch.tensor([0.1], dtype=torch.float64)}[dt_mode]
    goal = state(times[-1])
    ys = ts.load(spec)(u, *state(0.0)[:3], dt, j0=state(0.0)[3], goal=tuple(goal))
    for k, y in enumerate(ys):
        expect = np.array([derivative(t, k) for t in times])
        np.testing.assert_allclose(y[0, :, 0].numpy(), expect, rtol=0, atol=1e-9 * max(1, np.abs(expect).max()))
        assert y[0, H - 1, 0].item() == (goal[k].item() if k < 4 else 0.0)  # the goal state as given


# ---- kernels: C (native and Python paths) and the CUDA source on the host -----------------------


@pytest.mark.parametrize("overrides", GOAL_GRID, ids=[grid_id(g) for g in GOAL_GRID])
def test_kernels_match_reference_and_adjoint_dot_test(overrides):
    """Forward against the reference; gradients of every input by the dot test against the
    reference's forward: <M x, g> = <x, M^T g>, at 1e-12 (C, Python path, CUDA on the host)."""
    case = Case(spec_of(overrides), B=3)
    case.check_kernels(case.expected())


@pytest.mark.parametrize("overrides", GOAL_GRID, ids=[grid_id(g) for g in GOAL_GRID])
def test_gradcheck_with_forward_mode(overrides):
    """Gradients and forward-mode tangents of u, start, goal and every dt entry against finite
    differences (C kernels and the CUDA source on the host); double backward for the tensors."""
    Case(spec_of(overrides), B=2).check_gradcheck()


def test_per_trajectory_dt_equals_separate_uniform_calls():
    spec = spec_of(dict(end="goal", dt="per_trajectory"))
    case = Case(spec, B=4)
    ys = case.call(ts.load(spec), *case.tensors())
    uniform = ts.load(spec.replace(dt="uniform"))
    for b in range(case.B):
        one = [t[b:b + 1] for t in case.tensors()[:-1]]
        for y, z in zip(ys, case.call(uniform, *one, float(case.dt[b]))):
            assert torch.equal(y[b:b + 1], z)


def test_goal_index_equals_gathered_goals():
    spec = spec_of(dict(end="goal", goal_index=True))
    case = Case(spec, B=4)
    xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    ys = case.call(ts.load(spec), *xs, case.dt)
    plain = ts.load(spec.replace(goal_index=False))
    gathered = [g[case.gidx] for g in xs[5:]]
    zs = plain(*xs[:4], case.dt, j0=xs[4], goal=tuple(gathered))
    for y, z in zip(ys, zs):
        assert torch.equal(y, z)
    gen = torch.Generator().manual_seed(3)
    w = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ys]
    for a, b in zip(torch.autograd.grad(ys, xs[5:], w), torch.autograd.grad(zs, xs[5:], w)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # scatter-added through goal_index


def test_vmap_folds_a_per_trajectory_dt():
    from torch.func import vmap

    spec = spec_of(dict(end="goal", dt="per_trajectory"))
    case = Case(spec, B=3)
    step = ts.load(spec)
    V = 2
    gen = torch.Generator().manual_seed(4)
    us = torch.randn(V, *case.u.shape, generator=gen, dtype=torch.float64)
    dts = 0.05 + 0.1 * torch.rand(V, case.B, generator=gen, dtype=torch.float64)
    rest = case.tensors()[1:-1]
    got = vmap(lambda u, dt: case.call(step, u, *rest, dt))(us, dts)
    for v in range(V):
        for y, z in zip(got, case.call(step, us[v], *rest, dts[v])):
            assert torch.equal(y[v], z)


def test_compile_fullgraph_matches_eager():
    spec = spec_of(dict(end="goal", dt="per_trajectory", goal_index=True))
    Case(spec, B=3).check_compile()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_to_ptx(tmp_path):
    check_ptx([ts.source(spec_of(g, dtype), "cuda") for g in GOAL_GRID for dtype in ("float32", "float64")], tmp_path)


# ---- argument checks (both paths: the native node defers value problems to Python) -----------

@pytest.mark.parametrize("native", [True, False])
def test_bad_inputs_are_refused_before_any_kernel_runs(native):
    spec = spec_of(dict(end="goal", goal_index=True, dt="per_trajectory"))
    case = Case(spec, B=3)
    step = ts.load(spec)
    if not native:
        step.native = None
    u, p0, v0, a0, j0, gp, gv, ga, gj, dt = case.tensors()
    call = lambda **kw: step(u, p0, v0, a0, kw.pop("dt", dt), **{"goal": (gp, gv, ga), "goal_index": case.gidx, **kw})
    with pytest.raises(TypeError, match="gp: this kernel needs a gp argument"):
        step(u, p0, v0, a0, dt, goal_index=case.gidx)
    with pytest.raises(TypeError, match=r"goal: expected a tuple \(gp, gv, ga\[, gj\]\)"):
        call(goal=(gp, gv))
    with pytest.raises(ValueError, match=r"gv: expected shape \(4, 2\), got shape \(4, 3\)"):
        call(goal=(gp, torch.zeros(4, 3, dtype=torch.float64), ga))
    with pytest.raises(IndexError, match=r"goal_index: entry 4 is out of range: .*gp, gv, ga, gj.*number 4"):
        call(goal_index=torch.tensor([0, 4, 1]))
    with pytest.raises(TypeError, match="goal_index: this kernel needs a goal_index argument"):
        call(goal_index=None)
    with pytest.raises(ValueError, match=r"dt: expected shape \(3,\), one step duration per trajectory"):
        call(dt=torch.full((4,), 0.1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dt: expected finite, positive step durations.*\(entry 1\)"):
        call(dt=torch.tensor([0.1, -0.1, 0.1], dtype=torch.float64))
    with pytest.raises(TypeError, match=r"dt: this kernel takes one step duration per trajectory.*got a float"):
        call(dt=0.1)
    plain = ts.load(spec_of({}))
    with pytest.raises(TypeError, match="goal: this kernel takes no goal state"):
        plain(torch.zeros(3, H - 1, D, dtype=torch.float64), p0, v0, a0, 0.1, goal=(gp, gv, ga))


def test_config_and_cli(tmp_path):
    """A config with end: goal, goal_index and dt: per_trajectory: `show`, `check` (the kernels
    against the dense matrices) and `run` (forward and backward with a goal and a [B] dt)."""
    from click.testing import CliRunner

    from tensorstep.cli import main
    from tensorstep.config import load_config

    cfg = tmp_path / "toy.yml"
    cfg.write_text("robot: toy\ndof: 2\ndt: 0.05\nkernels:\n"
                   "  - {horizon: 8, end: goal, goal_index: true, dt: per_trajectory, dtype: float64}\n"
                   "  - {horizon: 8, control: jerk, dt: per_trajectory}\n")
    specs = load_config(cfg).specs
    assert specs[0].goal_index and specs[0].end == "goal" and specs[1].dt == "per_trajectory"
    invoke = lambda *args: CliRunner().invoke(main, [*args], catch_exceptions=False)
    shown = invoke("show", "--horizon", "6", "--dof", "2", "--end", "goal", "--goal-index", "--dt", "per_trajectory")
    assert shown.exit_code == 0 and "_goal_dtb_noidx_bhd_f32_o3_gidx_forward(" in shown.output
    checked = invoke("check", str(cfg))
    assert checked.exit_code == 0, checked.output
    ran = invoke("run", str(cfg), "-o", str(tmp_path / "out"), "--batch", "3")
    assert ran.exit_code == 0 and "grad u (3, 6, 2)" in ran.output, ran.output
