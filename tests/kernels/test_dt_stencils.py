"""The dt kernels of stencils (position and B-spline control) with a uniform or per-trajectory dt:
their interior rows are loops (position control: rows share coefficients, fixed table slots; a
B-spline: a loop over each span's rows, over the knots where enough repeat), so the source does
not grow with the horizon, and dt_vjp sums fixed slots in locals added to the accumulator once. Their dt gradients and tangents match finite
differences of the independent float64 references (tests/reference.py, tests/reference_bspline.py)
through the C kernels, the Python path and the CUDA source run on the host."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import reference
import reference_bspline
import tensorstep as ts
from helpers import BoundaryCase, as_bhd, kernel_paths, scale_close
from tensorstep.codegen.driver import generate, lowered
from tensorstep.codegen.statements import Call, For, Read, walk

H_LOOPS = 40  # long enough for interior loops

#: KernelSpec overrides: both dt modes, both C loop forms (bhd flattened or by row, bdh per dof),
#: goals, start indices
SPECS = [
    dict(difference="central", start_index=True),
    dict(difference="central", order=4, layout="bdh"),
    dict(difference="backward", accuracy=2, dt="per_trajectory"),
    dict(difference="central", end="goal", dt="per_trajectory", layout="bdh"),
]

#: B-splines, whose dt kernels are span loops only (no interior loops): a period of 2 and 3 rows
#: per knot span, many rows per knot span (s² > R, where the forward is span loops only too), a
#: goal at the end: every row of the dt kernels is a span loop, the boundary spans too
SPANS = [
    dict(control="bspline", degree=4, knots=10, steps=3),
    dict(control="bspline", degree=3, knots=9, steps=2, end="goal", dt="per_trajectory", layout="bdh",
         start_index=True),
    dict(control="bspline", degree=4, knots=4, steps=12, end="goal"),
    dict(control="bspline", degree=3, knots=3, steps=16, end="goal", dt="per_trajectory", layout="bdh",
         start_index=True),
]


def spec_of(overrides: dict, horizon: int = H_LOOPS, dtype: str = "float64", dof: int = 2) -> ts.KernelSpec:
    fields = {} if overrides.get("control") == "bspline" else {"horizon": horizon}  # a B-spline's is derived
    return ts.KernelSpec(dof=dof, dtype=dtype, **{**fields, **overrides})


def spec_id(overrides: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in overrides.items())


class Case(BoundaryCase):
    """Random inputs of a spec and the reference outputs at any step duration(s)."""

    def outputs(self, dt: np.ndarray) -> np.ndarray:
        """Reference outputs [K, B, H, D] (bhd) at dt: a scalar, or one per trajectory."""
        spec = self.spec
        u = as_bhd(self.u, spec)
        pick = lambda rows, index: torch.stack(rows, 1)[index if index is not None else slice(None)].numpy()
        s = pick(self.start, self.idx)
        g = pick(self.goal, self.gidx) if self.goal else None
        dts = np.broadcast_to(np.asarray(dt, dtype=np.float64), (self.B,))
        out = np.zeros((spec.order + 1, self.B, spec.horizon, spec.dof))
        for b in range(self.B):
            if spec.control == "bspline":
                out[:, b] = reference_bspline.trajectory(u[b], list(s[b]), None if g is None else list(g[b]),
                                                         spec.degree, spec.steps, float(dts[b])).Y
                continue
            for d in range(spec.dof):
                out[:, b, :, d] = reference.column(spec, u[b, :, d], s[b, :, d], float(dts[b]),
                                                   None if g is None else g[b, :, d])
        return out

    def derivative(self, direction: np.ndarray, eps: float = 1e-5) -> np.ndarray:
        """d/dε of the reference outputs at dt + ε·direction, ε = 0 (fourth-order central difference)."""
        dt = self.dt.numpy()
        f = lambda e: self.outputs(dt + e * direction)
        return (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)


@pytest.mark.parametrize("overrides", SPECS, ids=spec_id)
def test_dt_kernels_loop_over_the_interior(overrides):
    """dt_jvp and dt_vjp have interior loops, and no dt_vjp loop adds to the accumulator per
    iteration (on CUDA each addition is a block-wide reduction): each adds its local sums after."""
    program = lowered(spec_of(overrides))
    assert program.dt_jvp.loops and program.dt_vjp.loops
    for loop in program.dt_vjp.loops:
        assert not any(isinstance(n, Read) and n.macro == "ACC" for n in walk(tuple(loop.statements)))
        assert len(loop.init) == len(loop.finish) > 0


def _dt_source_size(spec: ts.KernelSpec) -> int:
    g = generate(spec, targets=("c", "cuda"), parts=("dt",))
    return sum(len(text) for text in g.sources.values())


@pytest.mark.parametrize("overrides,sizes", [
    (dict(difference="central", start_index=True), {"horizon": (64, 128, 256)}),
    (dict(difference="central", dt="per_trajectory", order=4), {"horizon": (64, 128, 256)}),
    (dict(control="bspline", degree=4, steps=4), {"knots": (15, 30, 60)}),
], ids=["uniform", "per_trajectory", "bspline"])
def test_dt_source_does_not_grow_with_the_horizon(overrides, sizes):
    """Interior rows are loops: an added row adds a few bytes at most (longer loop bounds), where
    the straight-line dt kernels grew by about a kilobyte per row (H=256: 300 KB per target)."""
    (field, values), = sizes.items()
    specs = [spec_of({**overrides, field: v}) for v in values]
    measured = {spec.horizon: _dt_source_size(spec) for spec in specs}
    rows = sorted(measured)
    per_row = (measured[rows[-1]] - measured[rows[0]]) / (rows[-1] - rows[0])
    assert per_row < 4, measured
    assert measured[rows[-1]] < 1.02 * measured[rows[0]], measured


def _dt_kernel_chars(spec: ts.KernelSpec) -> int:
    """Characters of the dt kernels' columns and loops (C and CUDA; not the once-per-call coefficient
    programs, which hold a line per distinct weight of a row)."""
    code = lowered(spec)
    kernels = (code.dt_jvp, code.dt_vjp)
    return sum(len(line) for k in kernels for line in k.body + [x for loop in k.loops for x in loop.lines])


@pytest.mark.parametrize("overrides", [
    dict(control="bspline", degree=4, knots=10),
    dict(control="bspline", degree=3, knots=4, end="goal", dt="per_trajectory"),
], ids=spec_id)
def test_bspline_dt_kernels_do_not_grow_with_the_steps(overrides):
    """A B-spline's boundary spans (on the start and goal states) are span loops in dt_jvp and
    dt_vjp too: the columns barely grow with the rows per span s (straight-line, they grew
    from 130 KB to 560 KB between s=12 and s=48 for the first spec: a row's statements per row)."""
    sizes = {steps: _dt_kernel_chars(spec_of({**overrides, "steps": steps})) for steps in (12, 48)}
    assert sizes[48] - sizes[12] < 36 * 200, sizes  # a few bytes per row (loop bounds), not a row's statements


@pytest.mark.parametrize("overrides", SPANS, ids=spec_id)
def test_bspline_dt_kernels_are_span_loops(overrides):
    """Every row of these dt kernels but the first (the start state) is in a span loop, and a span
    loop's fixed accumulator slots are local sums added once after it."""
    code = lowered(spec_of(overrides))
    jvp, vjp = code.dt_jvp.statements, code.dt_vjp.statements
    assert not code.dt_jvp.loops and not code.dt_vjp.loops
    assert all(s.args[0] == 0 for s in jvp if isinstance(s, Call) and s.macro.startswith("TY"))
    loops = [s for s in vjp if isinstance(s, For)]
    assert loops and not any(isinstance(n, Read) and n.macro == "ACC" and isinstance(n.args[0], int)
                             for n in walk(tuple(loops)))


def _dt_of(case: Case, seed: int) -> np.ndarray:
    """A random direction in dt's space (one entry, or one per trajectory)."""
    return np.random.default_rng(seed).normal(size=case.dt.shape)


@pytest.mark.parametrize("overrides", SPECS + SPANS, ids=spec_id)
def test_dt_vjp_matches_finite_differences(overrides):
    """The dt gradient of Σ g·Y against finite differences of the reference, along each of dt's
    entries (C, Python path, CUDA on the host)."""
    spec = spec_of(overrides)
    case = Case(spec, uniform_dt=0.09)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64)
             for y in case.call(ts.load(spec), *case.tensors())]
    g = np.stack([as_bhd(gk, spec) for gk in grads])
    expected = np.array([float((g * case.derivative(e.reshape(case.dt.shape))).sum())
                         for e in np.eye(case.dt.numel())])
    for name, step in kernel_paths(spec):
        dt = case.dt.clone().requires_grad_(True)
        (got,) = torch.autograd.grad(case.call(step, *case.tensors()[:-1], dt), [dt], grads)
        err = np.abs(got.numpy().reshape(-1) - expected)
        assert (err <= 1e-8 * np.maximum(1.0, np.abs(expected))).all(), (name, got, expected)


@pytest.mark.parametrize("overrides", SPECS + SPANS, ids=spec_id)
def test_dt_jvp_matches_finite_differences(overrides):
    """The outputs' tangent along a dt direction (forward mode) against finite differences of the
    reference (C, Python path, CUDA on the host)."""
    spec = spec_of(overrides)
    case = Case(spec, uniform_dt=0.09)
    direction = _dt_of(case, 4)
    expected = case.derivative(direction)
    for name, step in kernel_paths(spec):
        with fwAD.dual_level():
            dual = fwAD.make_dual(case.dt, torch.as_tensor(direction, dtype=torch.float64))
            outs = case.call(step, *case.tensors()[:-1], dual)
            tangents = [fwAD.unpack_dual(y).tangent for y in outs]
        for k, t in enumerate(tangents):
            scale_close(as_bhd(t, spec), expected[k], 1e-8)
