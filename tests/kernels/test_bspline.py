"""B-spline control (docs/semantics.md, B-spline control) against the independent float64 reference (tests/reference_bspline.py:
SciPy's BSpline on the full control polygon, boundary points by a numerical solve): operator
matrices, exact boundary rows, polynomial reproduction, the C kernels and the CUDA source run on
the host (forward, adjoint dot tests, gradcheck with forward AD, double backward), nvcc,
torch.compile, and the bad inputs."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from scipy.interpolate import BSpline

import reference_bspline as ref
import tensorstep as ts
from helpers import ReferenceCase, as_bhd, check_dt_derivatives, check_ptx, kernel_paths, scale_close

DOF = 2

#: (degree, knots, steps, end): degrees 3–6 (7 once), both ends, s ∈ {1, 3, 4, 20}
MATRIX_GRID = [
    (3, 2, 1, "hold"), (3, 4, 3, "goal"), (4, 8, 4, "hold"), (4, 3, 1, "goal"), (4, 1, 20, "goal"),
    (5, 3, 3, "hold"), (5, 2, 4, "goal"), (6, 1, 20, "hold"), (6, 2, 3, "goal"), (7, 2, 2, "goal"),
]
#: many rows per span: a span's rows loop over the phase (codegen/lower.py's span loops) where they
#: read the start or goal state, or the knots after the last; with s² > R every span does (no loops
#: over knots)
LONG_SPANS = [
    dict(degree=3, knots=4, steps=12),  # s² > R: span loops only
    dict(degree=4, knots=4, steps=6, end="goal"),  # loops over knots inside, span loops at both ends
    dict(degree=5, knots=3, steps=12, end="goal", dt="per_trajectory", layout="bdh", start_index=True),
]
#: kernel variants (each a spec's overrides), covering every option that applies to B-splines
KERNEL_GRID = [
    dict(degree=3, knots=2, steps=3),
    dict(degree=4, knots=3, steps=4, end="goal"),
    dict(degree=5, knots=2, steps=1, end="goal", dt="per_trajectory", goal_index=True, start_index=True),
    dict(degree=4, knots=2, steps=3, layout="bdh", order=4, dt="per_trajectory"),
    dict(degree=6, knots=1, steps=2, end="goal", order=4, layout="bdh"),
    # enough knots for interior spans: rows rolled into loops over knots (one per row of a span)
    dict(degree=3, knots=9, steps=3),
    dict(degree=4, knots=10, steps=2, end="goal", dt="per_trajectory", layout="bdh", start_index=True),
    *LONG_SPANS,
]


def spec_of(overrides: dict, dtype: str = "float64", dof: int = DOF) -> ts.KernelSpec:
    return ts.KernelSpec(dof=dof, control="bspline", dtype=dtype, **overrides)


def grid_id(overrides: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in overrides.items())


# ---- spec ---------------------------------------------------------------------------------------

def test_spec_fields_derived_horizon_and_names():
    spec = ts.KernelSpec(dof=7, control="bspline", knots=8, steps=4)
    assert (spec.degree, spec.end, spec.dt) == (4, "hold", "uniform")
    assert spec.horizon == (8 + 4 + 1) * 4 + 1 and spec.n_actions == 8 and spec.n_dt == 1
    assert spec.name == "ts_h53_d7_bsp_p4_n8_s4_hold_dtu_noidx_bhd_f32_o3"
    goal = ts.KernelSpec(dof=7, control="bspline", degree=5, knots=3, steps=2, end="goal", horizon=(3 + 5 + 2) * 2 + 1)
    assert goal.horizon == 21 and ts.KernelSpec.from_dict(goal.to_dict()) == goal
    assert ts.KernelSpec.from_dict(spec.to_dict()) == spec
    plain = ts.KernelSpec(horizon=6, dof=2).to_dict()  # other controls keep their dicts, keys and banners
    assert not {"degree", "knots", "steps"} & set(plain)


BAD_SPECS = [
    (dict(degree=2, knots=3, steps=2), r"KernelSpec.degree=2 is invalid: expected an integer in \[3, 7\]"),
    (dict(degree=8, knots=3, steps=2), r"KernelSpec.degree=8 is invalid: expected an integer in \[3, 7\]"),
    (dict(knots=0, steps=2), r"KernelSpec.knots=0 is invalid: expected an integer in \[1, "),
    (dict(steps=2), r"KernelSpec.knots=None is invalid: control='bspline' needs knots"),
    (dict(knots=3, steps=0), r"KernelSpec.steps=0 is invalid: expected an integer in \[1, "),
    (dict(knots=3, steps=2, horizon=20), r"KernelSpec.horizon=20 is invalid: .*has 17 rows .*give horizon=17"),
    (dict(knots=3, steps=2, dt="per_step"), r"KernelSpec.dt='per_step' is invalid: control='bspline' allows "
                                            r"'uniform', 'per_trajectory'"),
    (dict(knots=3, steps=2, end="one_sided"), r"KernelSpec.end='one_sided' is invalid: control='bspline' allows "
                                              r"'hold', 'goal'"),
    (dict(knots=3, steps=2, difference="backward"), r"KernelSpec.difference='backward' means nothing for "
                                                    r"control='bspline'"),
]


@pytest.mark.parametrize("fields,match", BAD_SPECS, ids=[m.split(" ")[0] for _, m in BAD_SPECS])
def test_bad_specs_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        ts.KernelSpec(dof=2, control="bspline", **fields)


def test_bspline_fields_are_refused_for_other_controls():
    with pytest.raises(ValueError, match=r"KernelSpec.knots=4 means nothing for control='position'"):
        ts.KernelSpec(horizon=8, dof=2, knots=4)
    with pytest.raises(ValueError, match=r"KernelSpec.horizon=None is invalid: required"):
        ts.KernelSpec(dof=2)


def test_argument_table_gives_u_the_knots_shape():
    from tensorstep.codegen.arguments import table

    t = table(spec_of(dict(knots=5, steps=3, end="goal", goal_index=True, dt="per_trajectory")))
    assert t.physical(t.input("u"), {"B": 4}) == (4, 5, DOF) and t.dt.shape == ("B",)
    assert t.family == "step_goal" and "knots" in t.input("u").meaning


# ---- operator against the independent reference --------------------------------------------------

@pytest.mark.parametrize("degree,knots,steps,end", MATRIX_GRID)
def test_operator_matrices_match_reference(degree, knots, steps, end):
    spec = ts.KernelSpec(dof=1, control="bspline", degree=degree, knots=knots, steps=steps, end=end,
                         dtype="float64", order=4)
    dt = 0.037
    got = ts.operator_matrices(spec, dt)
    rng = np.random.default_rng(degree * 100 + steps)
    state = lambda: [rng.normal(size=1) for _ in range(4)]
    expect = ref.trajectory(rng.normal(size=(knots, 1)), state(), state() if end == "goal" else None, degree,
                            steps, dt)
    scale_close(got["u"][:4], expect.jac_knots, 1e-12)
    scale_close(got["start"][:4], expect.jac_start, 1e-12)
    if end == "goal":
        scale_close(got["goal"][:4], expect.jac_goal, 1e-12)
    else:
        assert "goal" not in got
    snap_u, snap_s = snap_matrices(degree, knots, steps, end, dt)
    scale_close(got["u"][4], snap_u, 1e-12)
    scale_close(got["start"][4], snap_s, 1e-12)


def snap_matrices(degree: int, knots: int, steps: int, end: str, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """Snap rows (the basis's fourth derivative / kdt⁴; zero for cubics) of the knots and the start
    state, from SciPy's basis on the control polygon (the reference gives P..J only)."""
    D, n, kdt = degree, knots, steps * dt
    tail = D + 1 if end == "goal" else D
    m = D + 1 + n + tail
    grid = np.arange(-D, m + 1, dtype=np.float64)
    x = np.arange((m - D) * steps + 1) / steps
    W = BSpline(grid, np.eye(m), D)(x, nu=4) / kdt**4
    src_u = np.zeros((m, n))
    src_u[D + 1: D + 1 + n] = np.eye(n)
    if end == "hold":
        src_u[D + 1 + n:, n - 1] = 1.0
    src_s = np.zeros((m, 4))
    src_s[: D + 1] = ref.boundary_matrix(D, "start") * kdt ** np.arange(4)
    return W @ src_u, W @ src_s


@pytest.mark.parametrize("end", ["hold", "goal"])
@pytest.mark.parametrize("degree", [3, 5, 7])
def test_boundary_rows_are_the_states_exactly(end, degree):
    """Row 0 is the start state (snap 0) and, with end="goal", the last row the goal state: the
    derived coefficients cancel exactly, so the operator's rows are the states themselves."""
    from tensorstep.codegen.builders import build_operator

    spec = spec_of(dict(degree=degree, knots=2, steps=3, end=end, order=4))
    rows = {(r.k, r.h): r.terms for r in build_operator(spec).rows}
    last = spec.horizon - 1
    for k in range(5):
        assert rows[(k, 0)] == (((1, (("p0", "v0", "a0", "j0")[k], 0)),) if k < 4 else ())
        if end == "goal":
            assert rows[(k, last)] == (((1, (("gp", "gv", "ga", "gj")[k], 0)),) if k < 4 else ())


def control_points(poly: np.ndarray, degree: int, m: int, kdt: float) -> np.ndarray:
    """The control polygon (m points) of a polynomial (coefficients in τ, lowest first) on the uniform
    knot vector in span units: least squares on SciPy's design matrix (exact: the polynomial lies
    in the spline space)."""
    grid = np.arange(-degree, m + 1, dtype=np.float64)
    x = np.linspace(0.0, m - degree, 8 * m)
    A = BSpline.design_matrix(x, grid, degree).toarray()
    return np.linalg.lstsq(A, np.polynomial.polynomial.polyval(x * kdt, poly), rcond=None)[0]


@pytest.mark.parametrize("degree,steps,dt_mode", [(3, 1, "uniform"), (4, 4, "per_trajectory"), (5, 3, "uniform"),
                                                  (6, 20, "uniform"), (7, 2, "uniform")])
def test_polynomial_reproduces_itself(degree, steps, dt_mode):
    """A cubic given as its start and goal Taylor states and as its own control points is reproduced
    at every row, all derivatives (the C kernel, float64); with end="hold" a constant does."""
    knots, dt = 3, 0.05
    spec = spec_of(dict(degree=degree, knots=knots, steps=steps, end="goal", dt=dt_mode), dof=1)
    poly = np.array([0.3, -1.2, 0.7, 2.1])
    deriv = [np.polynomial.polynomial.polyder(poly, k) if k else poly for k in range(4)]
    value = lambda k, t: float(np.polynomial.polynomial.polyval(t, deriv[k]))
    kdt = steps * dt
    m = 2 * (degree + 1) + knots
    q = control_points(poly, degree, m, kdt)
    end_time = (spec.horizon - 1) * dt
    state = lambda t: [torch.tensor([[value(k, t)]], dtype=torch.float64) for k in range(4)]
    u = torch.tensor(q[degree + 1: degree + 1 + knots], dtype=torch.float64).reshape(1, knots, 1)
    dt_arg = torch.tensor([dt], dtype=torch.float64) if dt_mode == "per_trajectory" else dt
    ys = ts.load(spec)(u, *state(0.0)[:3], dt_arg, j0=state(0.0)[3], goal=tuple(state(end_time)))
    times = np.arange(spec.horizon) * dt
    for k in range(4):
        expect = np.array([value(k, t) for t in times])
        np.testing.assert_allclose(ys[k][0, :, 0].numpy(), expect, rtol=0, atol=1e-10 * max(1, np.abs(expect).max()))
    hold = spec_of(dict(degree=degree, knots=knots, steps=steps), dof=1)
    c = torch.full((1, 1), 0.7, dtype=torch.float64)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    P, V, A, J = ts.load(hold)(c.expand(1, knots).reshape(1, knots, 1).contiguous(), c, zero, zero, dt)
    assert torch.allclose(P, c.expand_as(P), rtol=0, atol=1e-14) and V.abs().max() < 1e-12


# ---- kernels: C (native and Python paths) and the CUDA source on the host -----------------------

class Case(ReferenceCase):
    """Random inputs of a B-spline spec (u holds the knots) and the reference outputs for them."""

    def __init__(self, spec, B: int = 3, seed: int = 0):
        super().__init__(spec, B, seed, uniform_dt=0.07)


def dense_snap(case: Case) -> np.ndarray:
    """Snap [B, R, D] from the operator's dense matrices (float64), gathered inputs."""
    spec = case.spec
    u = case.u.numpy() if spec.layout == "bhd" else case.u.numpy().transpose(0, 2, 1)
    out = np.zeros((case.B, spec.horizon, spec.dof))
    for b in range(case.B):
        dt = float(case.dt[b] if spec.dt == "per_trajectory" else case.dt)
        m = ts.operator_matrices(spec, dt)
        i = b if case.idx is None else int(case.idx[b])
        out[b] = m["u"][4] @ u[b] + m["start"][4] @ np.stack([x[i].numpy() for x in case.start])
        if case.goal:
            g = b if case.gidx is None else int(case.gidx[b])
            out[b] += m["goal"][4] @ np.stack([x[g].numpy() for x in case.goal])
    return out


@pytest.mark.parametrize("overrides", KERNEL_GRID, ids=[grid_id(g) for g in KERNEL_GRID])
def test_kernels_match_reference_and_adjoint_dot_test(overrides):
    """Forward against the reference (P..J; snap against the operator's dense matrices); gradients
    of every input by the dot test against the reference's forward, at 1e-12."""
    case = Case(spec_of(overrides))
    expect = case.expected()
    if case.spec.order == 4:  # snap: the dense operator (checked against SciPy above) applied per column
        expect = np.concatenate([expect, dense_snap(case)[None]])
    case.check_kernels(expect)


@pytest.mark.parametrize("overrides", LONG_SPANS, ids=[grid_id(g) for g in LONG_SPANS])
def test_long_spans_dt_gradient_and_tangent_match_reference(overrides):
    """With many rows per span, dt's gradient and tangent on every kernel path against the
    reference (check_dt_derivatives)."""
    check_dt_derivatives(Case(spec_of(overrides), B=2), kernel_paths(spec_of(overrides)))


#: enough knots that the dt kernels' interior spans are one loop over the knots
KNOT_LOOPS = [
    dict(degree=3, knots=12, steps=4),
    dict(degree=4, knots=13, steps=3, end="goal", dt="per_trajectory", layout="bdh", start_index=True),
]


@pytest.mark.parametrize("overrides", KNOT_LOOPS, ids=[grid_id(g) for g in KNOT_LOOPS])
def test_knot_loops_dt_gradient_and_tangent_match_reference(overrides):
    """The dt kernels loop over the knots of the interior spans (their coefficient slots the
    same at every knot, the rows and actions shifted): dt's gradient and tangent on every
    kernel path against the reference (check_dt_derivatives)."""
    from tensorstep.codegen.driver import generate

    spec = spec_of(overrides)
    for target in ("c", "cuda"):
        assert "for (int64_t kn = 0;" in generate(spec, targets=(target,), parts=("dt",)).source(target, "dt")
    check_dt_derivatives(Case(spec, B=2), kernel_paths(spec))


@pytest.mark.parametrize("vectors", [True, False], ids=["permute", "scalar"])
def test_per_trajectory_monomial_tables_match_reference(vectors, monkeypatch):
    """With a dt per trajectory, C fills a long table from its monomials c·dt^p
    (codegen/monomials.py): four slots at a time by a permute under GCC, else one at a time
    (SHUFFLE_WIDTH 0 here). Forward (the table), dt gradient (its reverse loop) and dt tangent
    (its tangent loop) against the reference, on both forms, float64; the float32 table's forward
    against float64's."""
    from tensorstep.codegen import monomials
    from tensorstep.codegen.driver import generate, lowered
    from tensorstep.runtime.api import Step
    from tensorstep.runtime.launch import CpuBackend, Launcher

    if not vectors:
        monkeypatch.setattr(monomials, "SHUFFLE_WIDTH", 0)
    spec = spec_of(dict(degree=4, knots=4, steps=12, end="goal", dt="per_trajectory"))
    table = lowered(spec).coefs.monomials
    assert table is not None and table.width <= 8

    def step_of(spec):
        generated = generate(spec, targets=("c",))
        source = generated.source("c")
        assert "TS_MONOMIALS_REVERSE();" in source and "TS_MONOMIALS_TANGENT();" in source
        assert ("__builtin_shuffle" in source) == vectors
        return Step(spec, torch.device("cpu"), Launcher(spec, CpuBackend(spec, source, dict(generated.metadata))))

    step = step_of(spec)
    case = Case(spec, B=3)
    ys = case.call(step, *case.tensors())
    scale_close(np.stack([as_bhd(y, spec) for y in ys]), case.expected(), 1e-11)
    check_dt_derivatives(case, [("c", step)])
    with torch.no_grad():
        singles = case.call(step_of(spec.replace(dtype="float32")), *[t.float() for t in case.tensors()])
    for y, y32 in zip(ys, singles):
        scale_close(y32.double().numpy(), y.detach().numpy(), 1e-5)


def test_long_spans_do_not_grow_the_columns():
    """The forward and adjoint columns and their loops barely grow with the rows per span s (they
    grew from 87 KB to 383 KB between s=12 and s=48 here, one straight-line row per row of a
    boundary span); only the coefficient table does (the distinct weights of the rows)."""
    from tensorstep.codegen.driver import lowered

    def code_chars(steps: int) -> int:
        code = lowered(spec_of(dict(degree=4, knots=3, steps=steps), "float32"))
        kernels = (code.forward, code.adjoint, code.adjoint_reads)
        return sum(len(line) for k in kernels for line in k.body + [x for loop in k.loops for x in loop.lines])

    small, large = code_chars(12), code_chars(48)
    assert large - small < 0.25 * small, (small, large)


@pytest.mark.parametrize("overrides", KERNEL_GRID[1:4], ids=[grid_id(g) for g in KERNEL_GRID[1:4]])
def test_gradcheck_with_forward_mode(overrides):
    """Gradients and tangents of knots, start, goal and dt (uniform and per trajectory) against
    finite differences (C and the CUDA source on the host); double backward for the tensors."""
    Case(spec_of(overrides), B=2).check_gradcheck()


def test_float32_and_out_match_float64():
    spec = spec_of(dict(degree=4, knots=3, steps=4, end="goal"))
    case = Case(spec)
    ys = case.call(ts.load(spec), *case.tensors())
    single = ts.load(spec.replace(dtype="float32"))
    xs32 = [t.float() for t in case.tensors()]
    outs = [torch.empty_like(y, dtype=torch.float32) for y in ys]
    with torch.no_grad():
        case.call(single, *xs32, out=outs)
    for y, o in zip(ys, outs):
        scale_close(o.double().numpy(), y.numpy(), 1e-5)


def test_vmap_over_knots():
    from torch.func import vmap

    spec = spec_of(dict(degree=4, knots=3, steps=2, dt="per_trajectory"))
    case = Case(spec, B=2)
    step = ts.load(spec)
    us = torch.randn(3, *case.u.shape, dtype=torch.float64)
    rest = case.tensors()[1:]
    got = vmap(lambda u: case.call(step, u, *rest))(us)
    for v in range(3):
        for y, z in zip(got, case.call(step, us[v], *rest)):
            assert torch.equal(y[v], z)


def test_compile_fullgraph_matches_eager():
    spec = spec_of(dict(degree=4, knots=3, steps=3, end="goal", dt="per_trajectory", goal_index=True))
    Case(spec).check_compile()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_to_ptx(tmp_path):
    specs = [spec_of(KERNEL_GRID[1], dtype) for dtype in ("float32", "float64")] + [spec_of(KERNEL_GRID[2], "float32")]
    check_ptx([ts.source(s, "cuda") for s in specs], tmp_path)


# ---- argument checks ----------------------------------------------------------------------------

@pytest.mark.parametrize("native", [True, False])
def test_bad_inputs_are_refused_before_any_kernel_runs(native):
    spec = spec_of(dict(degree=4, knots=3, steps=2, end="goal", dt="per_trajectory"))
    case = Case(spec)
    step = ts.load(spec)
    if not native:
        step.native = None
    u, p0, v0, a0, j0, gp, gv, ga, gj, dt = case.tensors()
    with pytest.raises(ValueError, match=r"u: expected shape \(3, 3, 2\), got shape \(3, 4, 2\)"):
        step(torch.zeros(3, 4, 2, dtype=torch.float64), p0, v0, a0, dt, goal=(gp, gv, ga))
    with pytest.raises(ValueError, match=rf"u: expected shape \(3, 3, 2\), got shape \(3, {spec.horizon - 1}, 2\)"):
        step(torch.zeros(3, spec.horizon - 1, 2, dtype=torch.float64), p0, v0, a0, dt, goal=(gp, gv, ga))
    with pytest.raises(TypeError, match="gp: this kernel needs a gp argument"):
        step(u, p0, v0, a0, dt)
    with pytest.raises(TypeError, match=r"dt: this kernel takes one step duration per trajectory.*got a float"):
        step(u, p0, v0, a0, 0.1, goal=(gp, gv, ga))


def test_config_and_cli(tmp_path):
    """control: bspline in tensorstep's YAML (the horizon default is not applied: it is derived);
    `show` prints the derived basis and boundary coefficients (exact fractions) before the source;
    `check` verifies the kernels against the dense matrices; `run` and `list` handle B-splines."""
    from click.testing import CliRunner

    from tensorstep.cli import main
    from tensorstep.config import load_config

    cfg = tmp_path / "toy.yml"
    cfg.write_text("robot: toy\ndof: 2\ndt: 0.05\ndefaults: {horizon: 16, difference: backward, dtype: float64}\n"
                   "kernels:\n  - {control: position}\n"
                   "  - {control: bspline, degree: 5, knots: 3, steps: 2, end: goal, dt: per_trajectory}\n"
                   "  - {control: bspline, knots: 2, steps: 4}\n")
    specs = load_config(cfg).specs
    assert specs[0].horizon == 16 and specs[0].difference == "backward"
    assert (specs[1].degree, specs[1].knots, specs[1].steps, specs[1].horizon) == (5, 3, 2, 21)
    assert (specs[2].degree, specs[2].horizon) == (4, 29)
    invoke = lambda *args: CliRunner().invoke(main, [*args], catch_exceptions=False)
    shown = invoke("show", "--control", "bspline", "--degree", "3", "--knots", "2", "--steps", "3", "--end", "goal",
                   "--kernel", "forward")
    assert shown.exit_code == 0, shown.output
    assert " *   B_0   1/6  -1/2   1/2  -1/6" in shown.output  # the cubic's basis matrix, exact
    assert " *   F_0     1    -1   1/3     0" in shown.output  # start point F_0 = p0 − kdt·v0 + kdt²/3·a0
    assert "_bsp_p3_n2_s3_goal_dtu_noidx_bhd_f32_o3_forward(" in shown.output
    bad = CliRunner().invoke(main, ["show", "--control", "bspline", "--knots", "2", "--steps", "3", "--horizon", "5"])
    assert bad.exit_code != 0 and "KernelSpec.horizon=5 is invalid" in bad.output and "give horizon=22" in bad.output
    checked = invoke("check", str(cfg))
    assert checked.exit_code == 0 and checked.output.count("PASS") >= 3, checked.output
    ran = invoke("run", str(cfg), "-o", str(tmp_path / "out"), "--batch", "3")
    assert ran.exit_code == 0 and "grad u (3, 3, 2)" in ran.output, ran.output
    listed = invoke("list", str(tmp_path / "out"))
    assert listed.exit_code == 0 and "degree 5 n=3 s=2" in listed.output


def test_bench_bspline_smoke():
    """`bench --scheme bspline` runs end to end: the PyTorch B-spline agrees with tensorstep before
    it is timed (tiny budget: this checks the command, not speed)."""
    from click.testing import CliRunner

    from tensorstep.cli import main

    result = CliRunner().invoke(main, ["bench", "--scheme", "bspline", "--batch", "2", "--dtype", "float64",
                                       "--no-codegen", "--no-inductor", "--budget", "0.01"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("| 4 | 8 | 4 | 53 | 2 | 7 | float64"))
    assert row.count("|") == 16 and "Forward only" not in result.output


def test_rows_of_a_span_roll_into_loops_over_knots():
    """Row h + s is row h with the knot index shifted by one: the forward and adjoint loop over
    knots around a loop over a span's rows (in C as on CUDA), so their straight-line columns do
    not grow with the knots (they did by about 7.5 KB per knot here)."""
    from tensorstep.codegen.driver import generate, lowered

    def column_chars(knots: int) -> int:
        code = lowered(spec_of(dict(degree=3, knots=knots, steps=10), "float32"))
        return sum(len(line) for kernel in (code.forward, code.adjoint) for line in kernel.body)

    small, large = column_chars(8), column_chars(16)
    assert large - small < 0.05 * small, (small, large)  # names of higher rows only
    source = generate(spec_of(dict(degree=3, knots=16, steps=10), "float32"), targets=("c",),
                      parts=("core",)).source("c", "core")
    assert "for (int64_t kn = 0; kn <= 12; ++kn) {" in source
    assert "for (int64_t r = 10 * kn + 40; r <= 10 * kn + 49; ++r) {" in source


def test_cuda_columns_do_not_grow_with_the_knots():
    """On CUDA the interior spans (the same weights, one action further per knot) are one loop over
    knots around the loops over a span's rows: the forward and adjoint columns are the same size
    at 20 and 60 knots (a loop per span: about 2 KB more per knot here, and nvcc's time grew
    with them)."""
    from tensorstep.codegen.driver import lowered

    def column_chars(knots: int) -> int:
        code = lowered(spec_of(dict(degree=4, knots=knots, steps=4), "float32", dof=7))
        return sum(len(line) for kernel in (code.forward, code.adjoint_reads) for line in kernel.body)

    small, large = column_chars(20), column_chars(60)
    assert large - small < 0.02 * small, (small, large)


@pytest.mark.parametrize("overrides", [dict(degree=4, knots=40, steps=4), dict(degree=5, knots=24, steps=3, end="goal"),
                                       dict(degree=3, knots=30, steps=7, dt="per_trajectory", layout="bdh")],
                         ids=grid_id)
def test_many_knots_match_reference_on_every_path(overrides):
    """Many knots (a long loop over knots on CUDA, its adjoint's moving window of accumulators):
    forward against the reference and the adjoint dot test, C and the CUDA source on the host."""
    case = Case(spec_of(overrides), B=2)
    case.check_kernels(case.expected())


def test_blocks_of_copies_hold_their_weights_once():
    """A loop's weights that the table already holds in consecutive slots (e.g. the tail of a longer
    span's) are read there: every block reads its weights in order, and the copies are fewer
    than the blocks' weights (s=25: 5388 slots before, 4965 now)."""
    from tensorstep.codegen.driver import lowered

    coefs = lowered(spec_of(dict(degree=4, knots=10, steps=25), "float32", dof=7)).coefs
    table = list(coefs.names) + coefs.copies  # slot q holds table[q]
    for values, at in coefs._blocks.items():
        assert tuple(table[at : at + len(values)]) == values
    assert len(coefs.copies) < sum(map(len, coefs._blocks)) - 300
