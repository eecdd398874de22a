"""Fused joint-space costs (KernelSpec.costs, .outputs): the step computes cost terms on its rows
and writes only the states asked for.

Checked against independent references: the states from tests/reference.py (NumPy), the terms
from their definitions (tests/reference_costs.py, NumPy), and the gradients against the plain
step plus the same costs written in PyTorch here (autograd through the plain step's kernels);
gradcheck and gradgradcheck with forward AD in float64.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import reference
import reference_costs
import tensorstep as ts
from tensorstep.codegen import fused, render
from tensorstep.codegen.arguments import table as argument_table
from tensorstep.codegen.driver import generate
from helpers import gradcheck64, gradgradcheck64
from sweep import FULL, sample

STATES = ("position", "velocity", "acceleration", "jerk", "snap")
TERMS = (("bound", "velocity"), ("squared", "position"), ("squared", "jerk"), ("bound", "acceleration"))
CASES = {
    "central": dict(horizon=9, dof=3),
    "backward": dict(horizon=9, dof=3, difference="backward", accuracy=2),
    "goal": dict(horizon=9, dof=3, end="goal"),
    "acceleration": dict(horizon=9, dof=3, control="acceleration"),
    "jerk_exact": dict(horizon=9, dof=3, control="jerk", integrator="exact"),
    "per_step": dict(horizon=9, dof=3, dt="per_step"),
    "indexed_bdh": dict(horizon=9, dof=3, start_index=True, layout="bdh"),
    "snap": dict(horizon=9, dof=3, order=4, accuracy=(2, 2, 2, 2)),
    # past fused.C_ROLL_ABOVE_H: C's fused columns too have their interior steps one loop
    "central_rolled": dict(horizon=41, dof=3),
    # past fused.C_ROLL_RECURRENCE_ABOVE_H: C's fused recurrence a loop forward, a reverse scan over segments back
    "jerk_rolled": dict(horizon=41, dof=3, control="jerk", integrator="exact"),
}
#: B-splines (their states' reference is the plain step, itself checked against SciPy elsewhere)
BSPLINES = {
    "bspline": dict(control="bspline", degree=4, knots=5, steps=2, dof=3),
    "bspline_goal_per_trajectory": dict(control="bspline", degree=3, knots=4, steps=3, dof=2, end="goal",
                                        dt="per_trajectory"),
}

#: a dt per trajectory: each CUDA thread computes its coefficients (monomials of its dt), in float64
#: their factors read from shared memory where they are used (codegen/targets.py
#: ``cuda_volatile_coefficients``): a stencil, a recurrence, B-splines (degree 5, many rows a span)
THREAD_COEFFICIENTS = {
    "central_per_trajectory": dict(horizon=9, dof=3, dt="per_trajectory"),
    "jerk_exact_per_trajectory": dict(horizon=9, dof=3, control="jerk", integrator="exact", dt="per_trajectory"),
    "bspline_per_trajectory": dict(control="bspline", degree=4, knots=6, steps=2, dof=2, dt="per_trajectory"),
    "bspline_degree5_per_trajectory": dict(control="bspline", degree=5, knots=7, steps=3, dof=2,
                                           dt="per_trajectory", order=4),
}
#: layout "bdh" above a warp's whole rows (float64 H > 32): the CUDA kernels stage row tiles
ROW_TILES = {"bdh_row_tiles": dict(horizon=40, dof=3, start_index=True, layout="bdh")}
#: float64 recurrences past H=100: the CUDA adjoint's segments longer, its checkpoints within a budget
#: (codegen/fused.py ``_segments``, ``CHECKPOINT_BYTES``)
LONG = {"jerk_exact_long": dict(horizon=104, dof=2, control="jerk", integrator="exact")}
#: position control's other boundary: CUDA's fused stencil columns are rolled at every horizon
ONE_SIDED = {"one_sided": dict(horizon=9, dof=3, end="one_sided")}
#: a wide stencil of order 4 with a duration per step: many first rows read the start state, whose
#: gradients CUDA's rolled adjoint sums step by step (codegen/fused.py ``adjoint_rolled``'s ``start_sums``)
WIDE = {"wide_per_step": dict(horizon=9, dof=3, difference="central", accuracy=8, order=4, dt="per_step")}


def _spec(case: str, outputs=("P",), terms=TERMS):
    every = {**CASES, **BSPLINES, **ROW_TILES, **LONG, **THREAD_COEFFICIENTS, **ONE_SIDED, **WIDE, **GRADCHECK_ONLY}
    return ts.KernelSpec(dtype="float64", costs=terms, outputs=outputs, **every[case])


def _data(spec, B: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    D = spec.dof
    S = B + 2 if spec.start_index else B
    x = dict(u=r(B, spec.n_actions, D), p0=r(S, D), v0=r(S, D), a0=r(S, D), j0=r(S, D))
    if spec.start_index:
        x["start_index"] = torch.tensor([3, 0, 4][:B]) if B <= 3 else torch.randint(0, S, (B,), generator=gen)
    G = B + 1 if spec.goal_index else B  # goal rows (and targets) picked by goal_index
    if spec.end == "goal":
        x["goal"] = tuple(r(G, D) for _ in range(4))
    if spec.goal_index:
        x["goal_index"] = torch.tensor([1, 3, 0][:B]) if B <= 3 else torch.randint(0, G, (B,), generator=gen)
    params = {}
    for kind, state in spec.costs:
        params[f"{kind}_{state}_weight"] = r(B, D).abs() + 0.1
        params[f"{kind}_{state}_row_weight"] = r(spec.horizon).abs()
        if kind == "bound":
            lo = -0.3 - r(D).abs()
            params[f"bound_{state}_limit"] = torch.stack([lo, lo + 0.5 + r(D).abs()])
            params[f"bound_{state}_margin"] = 0.05 * r(D).abs()
        if (kind, state) == ("squared", "position"):
            params["squared_position_target"] = r(G, D)
    dt = (0.05 + 0.05 * torch.rand(spec.n_dt if spec.dt == "per_step" else B, generator=gen, dtype=torch.float64)
          if spec.dt != "uniform" else 0.1)
    return x, params, dt


def _call(step, spec, x, params, dt):
    u = x["u"].transpose(1, 2) if spec.layout == "bdh" else x["u"]
    extra = {k: x[k] for k in ("start_index", "goal", "goal_index") if k in x}
    return step(u, x["p0"], x["v0"], x["a0"], dt, j0=x["j0"], **extra, **params)


def _reference(spec, x, params, dt):
    """States [K, B, H, D] (NumPy reference, bhd) and the cost [B, T] from the definitions."""
    B = x["u"].shape[0]
    rows = x["start_index"].numpy() if spec.start_index else np.arange(B)
    start = np.stack([x[n].numpy()[rows] for n in ("p0", "v0", "a0", "j0")], axis=1)
    picked = x["goal_index"].numpy() if "goal_index" in x else np.arange(B)
    goal = np.stack([g.numpy()[picked] for g in x["goal"]], axis=1) if "goal" in x else None
    params = {k: v[x["goal_index"]] if k == "squared_position_target" and "goal_index" in x else v
              for k, v in params.items()}
    dts = dt.numpy() if isinstance(dt, torch.Tensor) else dt
    dt_of = (lambda b: dts[b]) if spec.dt == "per_trajectory" else (lambda b: dts)
    K = spec.order + 1
    Y = np.zeros((K, B, spec.horizon, spec.dof))
    for b in range(B):
        for d in range(spec.dof):
            Y[:, b, :, d] = reference.column(spec.replace(costs=(), outputs=None), x["u"].numpy()[b, :, d],
                                             start[b, :, d], dt_of(b), None if goal is None else goal[b, :, d])
    cost = reference_costs.costs(spec.costs, {STATES[k]: Y[k] for k in range(K)},
                                 {k: v.numpy() for k, v in params.items()})
    return Y, cost


@pytest.mark.parametrize("case", CASES)
def test_values_match_the_definitions(case):
    spec = _spec(case, outputs=("P", "A"))
    x, params, dt = _data(spec)
    P, A, cost = _call(ts.load(spec), spec, x, params, dt)
    Y, expected = _reference(spec, x, params, dt)
    bhd = (lambda t: t.transpose(1, 2)) if spec.layout == "bdh" else (lambda t: t)
    np.testing.assert_allclose(bhd(P).numpy(), Y[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bhd(A).numpy(), Y[2], rtol=1e-12, atol=1e-12)
    assert cost.shape == (3, len(TERMS))
    np.testing.assert_allclose(cost.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


def _torch_costs(spec, states, params, x):
    """The terms from their definitions in PyTorch (bhd states [B, H, D])."""
    out = []
    for kind, state in spec.costs:
        y = states[STATES.index(state)]
        y = y.transpose(1, 2) if spec.layout == "bdh" else y
        w = params[f"{kind}_{state}_weight"][:, None, :] * params[f"{kind}_{state}_row_weight"][None, :, None]
        if kind == "squared":
            t = params.get("squared_position_target") if state == "position" else None
            t = t[x["goal_index"]] if t is not None and "goal_index" in x else t
            out.append((w * (y - (0 if t is None else t[:, None, :])) ** 2).sum((1, 2)))
        else:
            lo, hi = params[f"bound_{state}_limit"]
            m = params[f"bound_{state}_margin"]
            out.append((w * (torch.relu(y - (hi - m)) ** 2 + torch.relu((lo + m) - y) ** 2)).sum((1, 2)))
    return torch.stack(out, 1)


@pytest.mark.parametrize("dt_grad", [False, True], ids=["kernels", "with_dt"])
@pytest.mark.parametrize("case", [*CASES, *BSPLINES])
def test_gradients_match_the_plain_step_plus_costs(case, dt_grad):
    """Without a dt gradient the fused backward kernel runs; with one, the composite form."""
    spec = _spec(case, outputs=("P",))
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, dt_grad)


@pytest.mark.parametrize("case", ["central", "jerk_exact", "bspline"])
def test_margins_that_overlap_take_the_general_form(case):
    """Margins that leave lower + margin > upper − margin on a dof (y is then beyond one of them on
    every row, or both): the C kernels take each bound's general form (not its narrow form,
    codegen/costs.py ``CostKind.narrow``), values and gradients still the definitions'."""
    spec = _spec(case, outputs=("P",))
    x, params, dt = _data(spec)
    for kind, state in TERMS:
        if kind == "bound":
            lo, hi = params[f"bound_{state}_limit"]
            params[f"bound_{state}_margin"][0] = 0.75 * (hi[0] - lo[0])
    _fused_against_composite(spec, x, params, dt, False)


#: every value of every spec axis that CASES and BSPLINES leave out, straight-line columns (H ≤ 40):
#: velocity control, the exact integrator of velocity and acceleration control, jerk control's
#: semi-implicit Euler, end="one_sided" (C), a dt per trajectory on stencils and recurrences, layout "bdh"
#: without start_index and start_index with "bhd", goal_index (the target picked per trajectory), snap
#: on a recurrence, B-splines in "bdh" and with goal_index
GRID = {
    "velocity_bdh": dict(horizon=9, dof=3, control="velocity", layout="bdh"),
    "velocity_exact_per_trajectory_indexed": dict(horizon=9, dof=3, control="velocity", integrator="exact",
                                                  dt="per_trajectory", start_index=True),
    "acceleration_exact_per_step_indexed_bdh": dict(horizon=9, dof=3, control="acceleration", integrator="exact",
                                                    dt="per_step", start_index=True, layout="bdh"),
    "jerk_euler_per_trajectory_snap": dict(horizon=9, dof=3, control="jerk", dt="per_trajectory", order=4),
    "position_one_sided_per_trajectory_indexed_bdh": dict(horizon=9, dof=3, end="one_sided", dt="per_trajectory",
                                                         start_index=True, layout="bdh"),
    "position_backward_goal_index_per_step_indexed": dict(horizon=9, dof=3, difference="backward", accuracy=2,
                                                          end="goal", goal_index=True, dt="per_step",
                                                          start_index=True),
    "bspline_bdh_indexed": dict(control="bspline", degree=3, knots=4, steps=2, dof=2, layout="bdh", start_index=True),
    "bspline_goal_index_per_trajectory": dict(control="bspline", degree=3, knots=4, steps=2, dof=2, end="goal",
                                              goal_index=True, dt="per_trajectory"),
}


def _grid_spec(case: str) -> ts.KernelSpec:
    fields = GRID[case]
    terms = TERMS + ((("bound", "snap"),) if fields.get("order") == 4 else ())
    return ts.KernelSpec(dtype="float64", costs=terms, outputs=("P", "A"), **fields)


@pytest.mark.parametrize("case", GRID)
def test_every_spec_axis_against_the_definitions(case):
    """Each GRID case in C, float64: P, A and the cost against the NumPy references (1e-12; not
    B-splines), and P,
    the cost and the gradients of u, p0 and the target against the plain step plus the terms in
    PyTorch (1e-10), through the fused backward kernel; then the same in float32 against the
    float64 definitions (1e-5)."""
    spec = _grid_spec(case)
    x, params, dt = _data(spec)
    if spec.control != "bspline":  # (B-splines: against the plain step below, itself checked against SciPy)
        P, A, cost = _call(ts.load(spec), spec, x, params, dt)
        Y, expected = _reference(spec, x, params, dt)
        bhd = (lambda t: t.transpose(1, 2)) if spec.layout == "bdh" else (lambda t: t)
        np.testing.assert_allclose(bhd(P).numpy(), Y[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(bhd(A).numpy(), Y[2], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(cost.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
    spec = spec.replace(outputs=("P",))
    _fused_against_composite(spec, x, params, dt, False)
    single = spec.replace(dtype="float32")
    _fused_against_composite(spec, x, params, dt, False, fused_step=ts.load(single), fused_dtype=torch.float32,
                             tol=1e-5)


#: float64 order-4 recurrences whose rolled adjoint reads its actions again but keeps no checkpoint in C
#: (each segment's recomputed rows read only the action): C's template had defined the reread's macro only
#: with a checkpoint array, so these failed to load
REREAD_ONLY = [
    dict(control="velocity", horizon=200, dt="per_step", costs=(("bound", "acceleration"), ("squared", "acceleration"))),
    dict(control="velocity", horizon=128, integrator="exact", dt="per_step", layout="bdh",
         costs=(("squared", "jerk"),)),
]


@pytest.mark.parametrize("fields", REREAD_ONLY, ids=["velocity_h200", "velocity_exact_h128_bdh"])
def test_c_rolled_recurrences_that_only_reread_actions_match_the_definitions(fields):
    """C's adjoint of those specs (float64, order 4, P written) against the plain step plus the terms (1e-10)."""
    spec = ts.KernelSpec(dof=7, dtype="float64", order=4, outputs=("P",), **fields)
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, False)


@pytest.mark.parametrize("case", GRID)
def test_every_spec_axis_in_cuda_run_on_the_host(case):
    """The GRID cases' CUDA kernels (tests/cuda_on_host.py), float64: P, the cost and the gradients
    against the plain step plus the terms in PyTorch (1e-10)."""
    from cuda_on_host import host_step

    spec = _grid_spec(case).replace(outputs=("P",))
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, False, fused_step=host_step(spec))


def test_no_fused_cuda_kernel_uses_atomics():
    """The cost's sums (each term over its rows, then the dofs) and the target's and start state's
    gradients are summed in a fixed order on CUDA: no atomic operation whose order the scheduler
    would pick (the same bits on every run); every GRID, CASES and B-spline case, one dtype each,
    turn about (the sums are the same statements in either)."""
    for i, case in enumerate((*GRID, *CASES, *BSPLINES)):
        spec = _grid_spec(case) if case in GRID else _spec(case, outputs=("P",))
        dtype = ("float32", "float64")[i % 2]
        assert "atomic" not in ts.source(spec.replace(dtype=dtype), "cuda"), (case, dtype)


def test_paired_columns_give_the_plain_steps_states_to_rounding():
    """C's fused columns take a row's terms with coefficients of one magnitude as one product (a
    central stencil's c·(u[j+1] − u[j−1]); codegen/fused.py ``pairs``), so the states they write are the
    plain step's up to rounding, not bit for bit: float64, H=32 (interior rows), every state written,
    within 1e-13 of each state's largest value; the cost still the definitions' (1e-12)."""
    terms = tuple(("bound", s) for s in STATES[:4]) + tuple(("squared", s) for s in STATES[1:4])
    spec = ts.KernelSpec(horizon=32, dof=7, dtype="float64", costs=terms, outputs=("P", "V", "A", "J"))
    x, params, dt = _data(spec)
    for kind, state in terms:  # none given: ones, the variant without row weights
        del params[f"{kind}_{state}_row_weight"]
    *states, cost = _call(ts.load(spec), spec, x, params, dt)
    plain = spec.replace(costs=(), outputs=None)
    for got, expected in zip(states, _call(ts.load(plain), plain, x, {}, dt)):
        assert (got - expected).abs().max() <= 1e-13 * expected.abs().max()
    Y, reference_cost = _reference(spec, x, {**params, **{f"{k}_{s}_row_weight": torch.ones(32, dtype=torch.float64)
                                                           for k, s in terms}}, dt)
    np.testing.assert_allclose(cost.numpy(), reference_cost, rtol=1e-12, atol=1e-12 * np.abs(reference_cost).max())


@pytest.mark.parametrize("horizon", [9, 41], ids=["straight", "rolled"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_narrow_and_general_forms_give_the_same_bits(dtype, horizon):
    """A bound's narrow form gives its general form's bits: the same data run with every dof's margins
    allowing the narrow form, then with one dof's velocity margins overlapping (the call then takes
    the general form), that dof's velocity bound weighted 0 in both runs; states, cost and gradients
    equal. Straight-line columns, and rolled ones (past fused.C_ROLL_ABOVE_H)."""
    spec = ts.KernelSpec(horizon=horizon, dof=3, dtype=dtype, costs=TERMS, outputs=("P", "A"))
    x, params, _ = _data(spec)
    to = (lambda t: t.float()) if dtype == "float32" else (lambda t: t)
    x, params = {k: to(v) for k, v in x.items()}, {k: to(v) for k, v in params.items()}
    params["bound_velocity_weight"][:, 0] = 0
    lo, hi = params["bound_velocity_limit"]
    overlapping = {**params, "bound_velocity_margin": params["bound_velocity_margin"].clone()}
    overlapping["bound_velocity_margin"][0] = hi[0] - lo[0]
    step, runs = ts.load(spec), []
    for pp in (params, overlapping):
        u = x["u"].clone().requires_grad_()
        target = pp["squared_position_target"].clone().requires_grad_()
        outs = _call(step, spec, {**x, "u": u}, {**pp, "squared_position_target": target}, 0.1)
        sum(y.square().sum() for y in outs).backward()
        runs.append([*(y.detach() for y in outs), u.grad, target.grad])
    for narrow, general, name in zip(*runs, ("P", "A", "cost", "u", "target")):
        assert torch.equal(narrow, general), name


@pytest.mark.parametrize("case, dtype", [(case, "float64") for case in (
    "central", "per_step", "jerk_exact", "bspline", "central_rolled", "jerk_rolled")] + [
    ("central_rolled", "float32"), ("jerk_rolled", "float32")])
def test_any_number_of_threads_gives_the_same_bits(case, dtype):
    """B=300 (the C kernels split a batch of 64 and more over OpenMP threads, which follow
    torch.set_num_threads): states, cost and every gradient (u, the start state, dt, the target)
    are the same bits with 1, 2 and 3 threads; each trajectory's sums are its own (float32 past the
    thresholds: the forward's float runs)."""
    spec = _spec(case, outputs=("P", "J")).replace(dtype=dtype)
    x, params, dt = _data(spec.replace(dtype="float64"), B=300)
    to = lambda t: t.to(getattr(torch, dtype)) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    x, params, dt = {k: to(v) for k, v in x.items()}, {k: to(v) for k, v in params.items()}, to(dt)
    gen = torch.Generator().manual_seed(3)
    before, runs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            xs = {k: v.clone().requires_grad_(k != "start_index") for k, v in x.items()}
            ps = {k: v.clone().requires_grad_(k == "squared_position_target") for k, v in params.items()}
            d = dt.clone().requires_grad_() if torch.is_tensor(dt) else dt
            outs = _call(ts.load(spec), spec, xs, ps, d)
            gen.manual_seed(3)
            grads = [torch.randn(y.shape, generator=gen, dtype=y.dtype) for y in outs]
            wrt = [xs[k] for k in ("u", "p0", "v0", "a0") if k in xs] + [ps[k] for k in ps if ps[k].requires_grad]
            wrt += [d] if torch.is_tensor(d) else []
            runs.append([*(y.detach() for y in outs), *torch.autograd.grad(outs, wrt, grads)])
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("case, overlapping", [("central", False), ("jerk_exact", False), ("bspline", False),
                                               ("central", True)])
def test_row_weights_of_ones_against_the_definitions(case, overlapping):
    """Row weights all 1 (what the runtime passes where none are given): the C kernels take their
    variant without row weights (codegen/fused.py ``Form.unit_rows``), with the narrow forms or, with
    overlapping margins, the general ones; values and gradients still the definitions'."""
    spec = _spec(case, outputs=("P",))
    x, params, dt = _data(spec)
    for kind, state in TERMS:
        params[f"{kind}_{state}_row_weight"] = torch.ones(spec.horizon, dtype=torch.float64)
        if kind == "bound" and overlapping:
            lo, hi = params[f"bound_{state}_limit"]
            params[f"bound_{state}_margin"][0] = 0.75 * (hi[0] - lo[0])
    _fused_against_composite(spec, x, params, dt, False)


@pytest.mark.parametrize("overlapping", [False, True], ids=["narrow", "general"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_weights_of_ones_give_the_weighted_variants_bits(dtype, overlapping):
    """The variant without row weights gives the weighted variant's bits (a product with 1 is exact):
    the same data run with row weights all 1, then with one term's row weights 2 on every row, that
    term weighted 0 in both runs (so it adds 0 either way), the same output gradients; states and
    gradients equal, with the
    narrow forms and (one dof's velocity margins overlapping) the general ones. The cost may differ
    by the compiler's contraction of a row into its sum (``s + z*z`` is one fused multiply-add where
    ``s + 1*(z*z)`` rounded z*z first): within one rounding of each row, whose terms are ≥ 0, so
    within H·ε of the sum."""
    spec = ts.KernelSpec(horizon=9, dof=3, dtype=dtype, costs=TERMS, outputs=("P", "A"))
    x, params, _ = _data(spec)
    to = (lambda t: t.float()) if dtype == "float32" else (lambda t: t)
    x, params = {k: to(v) for k, v in x.items()}, {k: to(v) for k, v in params.items()}
    for kind, state in TERMS:
        params[f"{kind}_{state}_row_weight"] = torch.ones_like(params[f"{kind}_{state}_row_weight"])
    if overlapping:
        lo, hi = params["bound_velocity_limit"]
        params["bound_velocity_margin"][0] = hi[0] - lo[0]
    params["bound_acceleration_weight"].zero_()
    weighted = {**params, "bound_acceleration_row_weight": 2 * params["bound_acceleration_row_weight"]}
    step, runs = ts.load(spec), []
    for pp in (params, weighted):
        u = x["u"].clone().requires_grad_()
        target = pp["squared_position_target"].clone().requires_grad_()
        outs = _call(step, spec, {**x, "u": u}, {**pp, "squared_position_target": target}, 0.1)
        torch.autograd.backward(outs, [torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape) for y in outs])
        runs.append([*(y.detach() for y in outs), u.grad, target.grad])
    for unit, weighted_run, name in zip(*runs, ("P", "A", "cost", "u", "target")):
        if name == "cost":
            eps = torch.finfo(unit.dtype).eps
            assert ((unit - weighted_run).abs() <= spec.horizon * eps * weighted_run.abs()).all(), name
        else:
            assert torch.equal(unit, weighted_run), name
    assert runs[0][2][:, TERMS.index(("bound", "acceleration"))].eq(0).all()


def _fused_against_composite(spec, x, params, dt, dt_grad, fused_params=None, fused_step=None,
                             fused_dtype=torch.float64, tol=1e-10):
    """The fused step's P, cost and gradients against the plain step plus the terms in PyTorch (the
    fused step given ``fused_params`` where given: the same terms, row weights left to their default;
    ``fused_step``: another fused step of the spec, the loaded one where not given), within ``tol`` of
    the largest of each; the fused step's inputs and output gradients in ``fused_dtype`` (the plain
    step's in float64: a float32 fused step is then checked against float64 definitions)."""
    gen = torch.Generator().manual_seed(5)
    B = x["u"].shape[0]
    wcost = torch.randn(B, len(spec.costs), generator=gen, dtype=torch.float64)
    wP = torch.randn(B, spec.horizon, spec.dof, generator=gen, dtype=torch.float64)
    wP = wP.transpose(1, 2) if spec.layout == "bdh" else wP
    dt_t = torch.as_tensor(dt, dtype=torch.float64).reshape(-1).clone()
    if spec.dt == "per_trajectory":
        dt_t = dt_t.reshape(-1)
    grads = []
    for fused in (True, False):
        cast = lambda t: t.to(fused_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        to = (lambda t: tuple(map(cast, t)) if isinstance(t, tuple) else cast(t)) if fused else (lambda t: t)
        leaves = dict(u=to(x["u"]).clone().requires_grad_(), p0=to(x["p0"]).clone().requires_grad_())
        has_target = "squared_position_target" in params  # (a spec without a squared position term has none)
        target = to(params["squared_position_target"]).clone().requires_grad_() if has_target else None
        dt_leaf = to(dt_t).clone().requires_grad_(dt_grad)
        xx = {**{k: to(v) for k, v in x.items()}, **leaves}
        given_target = {"squared_position_target": target} if has_target else {}
        pp = {**{k: to(v) for k, v in params.items()}, **given_target}
        if fused:
            given = pp if fused_params is None else {**fused_params, **given_target}
            P, cost = _call(fused_step or ts.load(spec), spec, xx, given, dt_leaf)
        else:
            plain = spec.replace(costs=(), outputs=None)
            states = _call(ts.load(plain), plain, xx, {}, dt_leaf)
            P, cost = states[0], _torch_costs(spec, states, pp, xx)
        ((P * to(wP)).sum() + (cost * to(wcost)).sum()).backward()
        grads.append([t if t is None else t.detach().double()
                      for t in (P, cost, leaves["u"].grad, leaves["p0"].grad, None if target is None else target.grad, dt_leaf.grad)])
    for got, expected, name in zip(*grads, ("P", "cost", "u", "p0", "target", "dt")):
        if (not dt_grad and name == "dt") or (not has_target and name == "target"):
            assert got is None and expected is None
            continue
        scale = expected.abs().max()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * float(scale), msg=name)


@pytest.mark.parametrize("B", [4, 5])
@pytest.mark.parametrize("dof", [3, 4])
def test_two_trajectories_a_vector_against_the_plain_step_plus_costs(dof, B):
    """C's fused adjoint takes two trajectories per 512-bit vector where a row's lanes fill at most half
    of one (codegen/render.py ``paired``: float64 up to 4 dof here), in the form a call without row weights
    whose margins allow the bounds' narrow form runs; the last of an odd batch paired with itself; each
    trajectory's start rows picked by an index (each row of the pair at its own distance)."""
    spec = ts.KernelSpec(horizon=9, dof=dof, dtype="float64", costs=TERMS, outputs=("P",), start_index=True)
    assert "adjoint_narrow_unit_rows_single_batch" in generate(spec, ("c",), ("core",)).source("c", "core")
    x, params, dt = _data(spec, B=B)
    for kind, state in TERMS:
        del params[f"{kind}_{state}_row_weight"]
        if kind == "bound":  # margins within the limits: the narrow form
            lo, hi = params[f"bound_{state}_limit"]
            params[f"bound_{state}_margin"] = 0.1 * (hi - lo)
    _fused_against_composite(spec, x, {**params, **{f"{k}_{s}_row_weight": torch.ones(9, dtype=torch.float64)
                                                    for k, s in TERMS}}, dt, False, fused_params=params)


def test_two_trajectories_a_vector_in_float32_and_through_immintrin(tmp_path):
    """The same in float32 at the bench's 7 dof (two rows of 7 in 16 lanes), odd B, without row weights
    (the variant a call without them runs): u's gradient within float32 rounding of the float64 plain
    step plus the costs' gradient from the same inputs; and the kernels built through <immintrin.h>
    (``-DTS_LANE_INTRINSICS``) give the same bits as through the builtins."""
    spec = ts.KernelSpec(horizon=12, dof=7, dtype="float32", costs=TERMS, outputs=("P",))
    x, params, _ = _data(spec, B=5)
    for kind, state in TERMS:
        del params[f"{kind}_{state}_row_weight"]
    np.savez(tmp_path / "in.npz", **{k: v.float().numpy() for k, v in {**x, **params}.items()})
    run = textwrap.dedent(
        """
        import sys, numpy as np, torch, tensorstep as ts
        data = np.load(sys.argv[1])
        t = {k: torch.tensor(data[k]) for k in data.files}
        spec = ts.KernelSpec(horizon=12, dof=7, dtype="float32", costs=%r, outputs=("P",))
        u = t.pop("u").requires_grad_()
        P, cost = ts.load(spec)(u, t.pop("p0"), t.pop("v0"), t.pop("a0"), 0.1, j0=t.pop("j0"), **t)
        wc = torch.linspace(0.5, 2, cost.numel()).reshape(cost.shape)
        ((P * torch.linspace(-1, 1, P.numel()).reshape(P.shape)).sum() + (cost * wc).sum()).backward()
        np.save(sys.argv[2], u.grad.numpy())
        """ % (TERMS,))
    grads = []
    for switch in ("", "-DTS_LANE_INTRINSICS"):
        env = {**os.environ, "TENSORSTEP_CFLAGS": (os.environ.get("TENSORSTEP_CFLAGS", "") + " " + switch).strip()}
        out = tmp_path / f"grad{len(grads)}.npy"
        done = subprocess.run([sys.executable, "-c", run, str(tmp_path / "in.npz"), str(out)], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        grads.append(np.load(out))
    assert np.array_equal(grads[0], grads[1])
    data = {k: torch.tensor(v).double() for k, v in np.load(tmp_path / "in.npz").items()}
    plain = ts.KernelSpec(horizon=12, dof=7, dtype="float64")
    u = data.pop("u").requires_grad_()
    states = ts.load(plain)(u, data.pop("p0"), data.pop("v0"), data.pop("a0"), 0.1, j0=data.pop("j0"))
    params64 = {**data, **{f"{k}_{s}_row_weight": torch.ones(12, dtype=torch.float64) for k, s in TERMS}}
    cost = _torch_costs(spec.replace(dtype="float64"), states, params64, {})
    P = states[0]
    wc = torch.linspace(0.5, 2, cost.numel(), dtype=torch.float64).reshape(cost.shape)
    ((P * torch.linspace(-1, 1, P.numel(), dtype=torch.float64).reshape(P.shape)).sum() + (cost * wc).sum()).backward()
    expected = u.grad.numpy()
    assert np.abs(grads[0] - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("dtype, dof", [("float32", 7), ("float64", 3)])
def test_two_trajectories_a_vector_on_both_sides_of_the_threshold(dtype, dof):
    """A thread's share of at most ``render.PAIR_MAX_BATCH`` trajectories runs the paired adjoint (each
    row of a pair loaded by halves), a larger share one trajectory a vector: a batch above it with one
    thread and split below it by two; P, the cost and the gradients of u, the start position and the
    target are the same bits either way, and u's gradient is the plain step's plus the terms' in
    PyTorch (float64: 1e-10; float32: within its rounding of the float64 reference)."""
    spec = ts.KernelSpec(horizon=9, dof=dof, dtype=dtype, costs=TERMS, outputs=("P",))
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    assert f"#define TS_PAIR_MAX_BATCH {render.PAIR_MAX_BATCH}" in source
    assert "__builtin_shufflevector(VLOAD(p), VLOAD(p + s)" in source
    B = render.PAIR_MAX_BATCH + render.PAIR_MAX_BATCH // 2  # one thread: above; two threads: each share below
    x, params, _ = _data(spec, B=B)
    for kind, state in TERMS:
        del params[f"{kind}_{state}_row_weight"]
        if kind == "bound":  # margins within the limits: the narrow form, which is the paired one
            lo, hi = params[f"bound_{state}_limit"]
            params[f"bound_{state}_margin"] = 0.1 * (hi - lo)
    to = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(7)
    wP = torch.randn(B, spec.horizon, dof, generator=gen, dtype=torch.float64)
    wcost = torch.randn(B, len(spec.costs), generator=gen, dtype=torch.float64)
    step, runs, before = ts.load(spec), [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            xs = {k: v.to(to, copy=True).requires_grad_(k in ("u", "p0")) for k, v in x.items()}
            ps = {k: v.to(to, copy=True).requires_grad_(k == "squared_position_target") for k, v in params.items()}
            P, cost = _call(step, spec, xs, ps, 0.1)
            torch.autograd.backward([P, cost], [wP.to(to), wcost.to(to)])
            runs.append([P.detach(), cost.detach(), xs["u"].grad, xs["p0"].grad, ps["squared_position_target"].grad])
    finally:
        torch.set_num_threads(before)
    for one, two, name in zip(*runs, ("P", "cost", "u", "p0", "target")):
        assert torch.equal(one, two), name
    plain = spec.replace(costs=(), outputs=None, dtype="float64")
    u = x["u"].clone().requires_grad_()
    states = _call(ts.load(plain), plain, {**x, "u": u}, {}, 0.1)
    ones = {f"{k}_{s}_row_weight": torch.ones(spec.horizon, dtype=torch.float64) for k, s in TERMS}
    cost = _torch_costs(plain.replace(costs=TERMS), states, {**params, **ones}, {})
    ((states[0] * wP).sum() + (cost * wcost).sum()).backward()
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert (runs[0][2].double() - u.grad).abs().max() <= tol * u.grad.abs().max()


@pytest.mark.parametrize("narrow", [False, True], ids=["general", "narrow"])
@pytest.mark.parametrize("case", ["indexed_bdh", "goal", "central_rolled", "jerk_rolled", "bspline"])
def test_rows_asked_for_ahead_leave_the_values(case, narrow):
    """C's fused forward and adjoint ask for the rows of the trajectory ``render.PREFETCH_AHEAD`` ahead
    (codegen/macros.py ``prefetches``): the actions, each per-trajectory input at the row its index
    picks, the outputs' rows to be written (forward), their gradients (adjoint), on a thread's share of
    more than ``render.PREFETCH_FROM_BYTES`` of those rows; the plain step's kernels too, but a stencil's. On one
    thread with such a share (the last trajectories, whose later ones are past the batch, ask for
    none), the values and gradients are the plain step's plus the terms' (float64, 1e-10): in the
    general form, and in the narrow form without row weights."""
    spec = _spec(case, outputs=("P",))
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    assert f"#define TS_PREFETCH_FROM_BYTES {render.PREFETCH_FROM_BYTES}LL" in source
    table = argument_table(spec)
    for kernel in ("forward", "adjoint"):
        batch = source[source.index(f"{spec.name}_{kernel}_batch("):source.index(f"void {spec.name}_{kernel}(")]
        for name in [table.action.c_name, *(a.c_name for a in table.columns)]:
            assert f"TS_PREFETCH_ROW({name} + " in batch, (kernel, name)
        for a in table.outputs:  # the forward's rows asked for to be written, the adjoint's gradients read
            wanted = f"TS_PREFETCH_ROW({a.grad_name} + " if kernel == "adjoint" else f"TS_PREFETCH_ROW_WRITE({a.c_name} + "
            assert wanted in batch, (kernel, a.name)
    assert "TS_PREFETCH_ROW(p0 + (idx ? idx[ahead] : (ahead)) * D_, D_);" in source
    plain = spec.replace(costs=(), outputs=None)  # a stencil's loops stream the rows (tests/kernels/test_rows_ahead.py)
    assert ("TS_PREFETCH_ROW(" in generate(plain, ("c",), ("core",)).source("c", "core")) == (spec.control != "position")
    # the gate counts every row a kernel asks for: the actions and P's at least
    B = render.PREFETCH_FROM_BYTES // ((spec.n_actions + spec.horizon) * spec.dof * 8) + 2 * render.PREFETCH_AHEAD + 3
    x, params, dt = _data(spec, B=B)
    fused_params = None
    if narrow:
        fused_params = {k: v for k, v in params.items() if not k.endswith("_row_weight")}
        for kind, state in spec.costs:
            params[f"{kind}_{state}_row_weight"] = torch.ones(spec.horizon, dtype=torch.float64)
            if kind == "bound":  # margins within the limits
                lo, hi = params[f"bound_{state}_limit"]
                params[f"bound_{state}_margin"] = fused_params[f"bound_{state}_margin"] = 0.1 * (hi - lo)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _fused_against_composite(spec, x, params, dt, False, fused_params=fused_params)
    finally:
        torch.set_num_threads(before)


#: a control the other case lists leave to the grid below, under gradcheck here so that every control is
GRADCHECK_ONLY = {"velocity": dict(horizon=8, dof=2, control="velocity")}


@pytest.mark.parametrize("case, cuda", [("central", False), ("velocity", False), ("acceleration", False), ("goal", False),
                                        ("jerk_exact", False), ("bspline", False),
                                        ("central", True), ("one_sided", True), ("bspline", True)])
def test_gradcheck_and_gradgradcheck(case, cuda):
    """With forward AD; ``cuda``: the CUDA source run on the host at H=16 (tests/cuda_on_host.py), a
    fused stencil's columns rolled (a loop over the interior steps; a B-spline's, 8 knots: over the
    interior knot spans)."""
    spec = _spec(case, outputs=("P",), terms=(("bound", "velocity"), ("squared", "position")))
    if cuda:
        from cuda_on_host import host_step

        spec = spec.replace(knots=8, horizon=None) if spec.control == "bspline" else spec.replace(horizon=16)
    x, params, dt = _data(spec, B=2)
    step = host_step(spec) if cuda else ts.load(spec)

    def f(u, p0, target):
        return _call(step, spec, {**x, "u": u, "p0": p0}, {**params, "squared_position_target": target}, dt)

    inputs = [x["u"].clone().requires_grad_(), x["p0"].clone().requires_grad_(),
              params["squared_position_target"].clone().requires_grad_()]
    assert gradcheck64(f, inputs, check_forward_ad=True)
    assert gradgradcheck64(f, inputs)


@pytest.mark.parametrize("bad, message", [
    (lambda p: p.update(bound_velocity_weight=p["bound_velocity_weight"].clone().requires_grad_()), "take no gradient"),
    (lambda p: p.update(bound_velocity_margin=-p["bound_velocity_margin"] - 1), "expected values >= 0"),
    (lambda p: p.update(bound_velocity_limit=p["bound_velocity_limit"].flip(0) + torch.tensor([[1.0], [-1.0]], dtype=torch.float64)), "lower > upper"),
    (lambda p: p.update(bound_velocity_limit=p["bound_velocity_limit"] * float("inf")), "finite"),
    (lambda p: p.pop("bound_velocity_limit"), "bound_velocity_limit"),
    (lambda p: p.update(squared_jerk_weight=p["squared_jerk_weight"][:, :2]), "squared_jerk_weight"),
    # a NaN is not < 0, an infinite weight times a zero term is NaN: weights and margins must be finite too
    (lambda p: p["bound_velocity_weight"].__setitem__((1, 2), float("nan")), "bound_velocity_weight: expected finite"),
    (lambda p: p["squared_jerk_row_weight"].__setitem__(4, float("inf")), "squared_jerk_row_weight: expected finite"),
    (lambda p: p["bound_acceleration_margin"].__setitem__(0, float("inf")), "bound_acceleration_margin: expected finite"),
    (lambda p: p.update(bound_velocity_limt=p.pop("bound_velocity_limit")), "did you mean 'bound_velocity_limit'"),
])
def test_bad_parameters_are_named(bad, message):
    spec = _spec("central")
    x, params, dt = _data(spec)
    bad(params)
    with pytest.raises((ValueError, TypeError), match=message):
        _call(ts.load(spec), spec, x, params, dt)


def test_a_keyword_of_a_term_the_spec_lacks_names_the_term():
    """A cost keyword of a term the spec's costs lack says so (the term, the spec's terms, where a term
    is added, what it takes), not "did you mean" another term's keyword; a state past the spec's order
    says the order it needs; a misspelt keyword of a term the spec has keeps its "did you mean"; a
    parameter the term does not take is named. The same on every path that checks keywords: a call
    (the native node's and the Python path's), forward, a goal spec's call, set_costs."""
    lacks = ("the spec's costs have no ('bound', 'jerk') term (its terms: ('bound', 'velocity'), ('squared', "
             "'position'), ('squared', 'jerk'), ('bound', 'acceleration')); a term is added in KernelSpec.costs "
             "(or a YAML config's costs:); the ('bound', 'jerk') term takes: bound_jerk_weight, bound_jerk_row_weight, "
             "bound_jerk_limit, bound_jerk_margin")
    expected = {
        "bound_jerk_limit": lacks,
        "bound_velocity_limt": "did you mean 'bound_velocity_limit'? the ('bound', 'velocity') term takes: "
                               "bound_velocity_weight, bound_velocity_row_weight, bound_velocity_limit, bound_velocity_margin",
        "squared_jerk_limit": "the ('squared', 'jerk') term takes no limit; it takes: squared_jerk_weight, "
                              "squared_jerk_row_weight",
        "bound_snap_margin": "a term is added in KernelSpec.costs (or a YAML config's costs:); snap needs order=4, "
                             "the spec's order is 3; the ('bound', 'snap') term takes: bound_snap_weight,",
    }
    for case in ("central", "goal"):
        spec = _spec(case)
        x, params, dt = _data(spec)
        for path in ("native", "python"):
            step = ts.load(spec)
            if path == "python":
                step.native = None
            calls = {"call": lambda kw: _call(step, spec, x, {**params, **kw}, dt),
                     "forward": lambda kw: step.forward(x["u"], x["p0"], x["v0"], x["a0"], dt, j0=x["j0"],
                                                        **({"goal": x["goal"]} if "goal" in x else {}), **params, **kw),
                     "set_costs": lambda kw: step.set_costs(**kw)}
            for name, message in expected.items():
                for how, call in calls.items():
                    with pytest.raises(TypeError) as err:
                        call({name: params["bound_velocity_limit"]})
                    what = "no cost parameter of that name" if how == "set_costs" else \
                        "this kernel takes no argument of that name"
                    assert str(err.value).startswith(f"{name}: {what}; "), (case, path, how, str(err.value))
                    assert message in str(err.value), (case, path, how, str(err.value))
                    if name == "bound_jerk_limit":  # the whole message: nothing about another term's keyword
                        assert str(err.value) == f"{name}: {what}; {lacks}"
    plain = ts.load(ts.KernelSpec(horizon=9, dof=3, dtype="float64"))
    with pytest.raises(TypeError, match=re.escape("squared_jerk_weight: this kernel takes no argument of that name; "
                                                  "the spec has no cost terms (no ('squared', 'jerk') term); a term is "
                                                  "added in KernelSpec.costs")):
        plain(x["u"], x["p0"], x["v0"], x["a0"], dt, squared_jerk_weight=params["squared_jerk_weight"])


def test_a_weight_per_dof_of_another_length_is_named_as_given():
    """A [D] weight stands for every trajectory: one of another length is refused with the shape given
    and the two shapes allowed, not the shape of its expansion to [B, D] (in a call and in set_costs)."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = ts.load(spec)
    message = re.escape("squared_jerk_weight: expected shape (3,) (one weight per dof) or (B, 3), got shape (4,)")
    with pytest.raises(ValueError, match=message):
        _call(step, spec, x, {**params, "squared_jerk_weight": torch.ones(4, dtype=torch.float64)}, dt)
    with pytest.raises(ValueError, match=message):
        step.set_costs(squared_jerk_weight=torch.ones(4, dtype=torch.float64))


def test_a_weight_per_dof_applies_to_every_trajectory():
    spec = _spec("central")
    x, params, dt = _data(spec)
    shared = params["squared_jerk_weight"][0]
    _, got = _call(ts.load(spec), spec, x, {**params, "squared_jerk_weight": shared}, dt)
    _, expected = _call(ts.load(spec), spec, x, {**params, "squared_jerk_weight": shared.expand(3, -1).clone()}, dt)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_compile_vmap_export_and_out():
    """torch.compile(fullgraph=True), vmap and torch.export give the eager values and gradients;
    out= (rollouts, no gradients) writes the states and the cost into the caller's tensors."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = ts.load(spec)

    def loss(u):
        P, cost = _call(step, spec, {**x, "u": u}, params, dt)
        return P.square().sum() + cost.sum()

    u = x["u"].clone().requires_grad_()
    eager = loss(u)
    (g_eager,) = torch.autograd.grad(eager, u)
    compiled = torch.compile(loss, fullgraph=True)(u)
    (g_compiled,) = torch.autograd.grad(compiled, u)
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-12, atol=1e-12 * float(g_eager.abs().max()))

    cost_of = lambda uu: _call(step, spec, {**x, "u": uu}, params, dt)[1]
    stacked = torch.stack([x["u"], 2 * x["u"]])
    torch.testing.assert_close(torch.func.vmap(cost_of)(stacked), torch.stack([cost_of(x["u"]), cost_of(2 * x["u"])]),
                               rtol=1e-12, atol=0)

    class Loss(torch.nn.Module):
        def forward(self, uu):
            return loss(uu)

    exported = torch.export.export(Loss(), (x["u"],))
    torch.testing.assert_close(exported.module()(x["u"]), loss(x["u"]), rtol=1e-12, atol=0)

    with torch.no_grad():
        P, C = torch.empty(3, spec.horizon, spec.dof, dtype=torch.float64), torch.empty(3, len(TERMS), dtype=torch.float64)
        step(x["u"], x["p0"], x["v0"], x["a0"], dt, j0=x["j0"], out=(P, C), **params)
        expected = _call(step, spec, x, params, dt)
    assert torch.equal(P, expected[0]) and torch.equal(C, expected[1])


def _loaded(spec, path: str):
    """A step whose calls take the native node where it is built ("native": the Python path checks and
    keeps the parameters, the node takes unchanged calls), or every call the Python path ("python":
    as on CUDA, which has no native node)."""
    from tensorstep.runtime import native

    native.wait()  # no build under way that would give the step its node later
    step = ts.load(spec)
    if path == "python":
        step.native = None
    return step


PATHS = pytest.mark.parametrize("path", ["native", "python"])


@PATHS
def test_a_parameter_changed_in_place_is_checked_again(path):
    """Checks are skipped for a parameter tensor seen unchanged; writing into it makes it new."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = _loaded(spec, path)
    _call(step, spec, x, params, dt)
    _call(step, spec, x, params, dt)
    params["bound_velocity_margin"].sub_(10.0)  # now negative, same storage
    with pytest.raises(ValueError, match="bound_velocity_margin: expected values >= 0"):
        _call(step, spec, x, params, dt)


@PATHS
def test_a_weight_per_dof_changed_in_place_is_read_and_checked_again(path):
    """A [D] weight's rows for the kernels are kept while the caller passes the same tensor
    unchanged: written into (or a new batch size), the kernels read the new values, and a
    negative one is refused."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = _loaded(spec, path)
    shared = params["squared_jerk_weight"][0].clone()
    t = spec.costs.index(("squared", "jerk"))
    first = _call(step, spec, x, {**params, "squared_jerk_weight": shared}, dt)[-1]
    torch.testing.assert_close(_call(step, spec, x, {**params, "squared_jerk_weight": shared}, dt)[-1], first,
                               rtol=0, atol=0)
    shared.mul_(3.0)
    again = _call(step, spec, x, {**params, "squared_jerk_weight": shared}, dt)[-1]
    torch.testing.assert_close(again[:, t], 3.0 * first[:, t], rtol=1e-12, atol=0)
    torch.testing.assert_close(again[:, :t], first[:, :t], rtol=0, atol=0)
    two = {k: v[:2] for k, v in x.items()}
    per_trajectory = {k: v[:2] for k, v in params.items() if v.dim() == 2 and not k.endswith("_limit")}  # [B, D]
    smaller = _call(step, spec, two, {**params, **per_trajectory, "squared_jerk_weight": shared}, dt)[-1]
    torch.testing.assert_close(smaller, again[:2], rtol=1e-12, atol=0)
    shared.neg_()
    with pytest.raises(ValueError, match="squared_jerk_weight: expected values >= 0"):
        _call(step, spec, x, {**params, "squared_jerk_weight": shared}, dt)


@pytest.mark.parametrize("case", ["central", "indexed_bdh", "jerk_exact"])
def test_calls_with_parameters_checked_before_take_the_native_node(case, monkeypatch):
    """A call whose cost parameters passed the Python checks unchanged goes straight to the native
    node (no Python check runs), with the values and gradients of the Python autograd path (an
    indexed start's rows summed); a parameter written into is checked again."""
    from tensorstep.runtime import validate

    spec = _spec(case, outputs=("P", "A"))
    step = ts.load(spec)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    x, params, dt = _data(spec)
    dt = torch.as_tensor(dt, dtype=torch.float64)
    checks = []
    check_inputs = validate.check_inputs
    monkeypatch.setattr(validate, "check_inputs", lambda *a: checks.append(1) or check_inputs(*a))
    results = []
    for native in (None, step.native, step.native):
        step.native = native  # None: the Python autograd path
        u, p0 = x["u"].clone().requires_grad_(), x["p0"].clone().requires_grad_()
        target = params["squared_position_target"].clone().requires_grad_()
        ys = _call(step, spec, {**x, "u": u, "p0": p0}, {**params, "squared_position_target": target}, dt)
        weights = [1 + torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) % 3 for y in ys]
        torch.autograd.backward(ys, weights)
        results.append((ys[0].grad_fn.name(), len(checks), [*(y.detach() for y in ys), u.grad, p0.grad, target.grad]))
    assert "NativeStep" not in results[0][0] and "NativeStep" in results[2][0]
    assert results[2][1] == results[1][1]  # the third call ran no Python check
    for got, expected in zip(results[2][2], results[0][2]):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13 * float(expected.abs().max()))
    params["bound_velocity_limit"][0].fill_(5.0)  # lower > upper now, same tensor
    with pytest.raises(ValueError, match="bound_velocity_limit: lower > upper"):
        _call(step, spec, x, params, dt)
    params["bound_velocity_limit"][0].fill_(-5.0)
    _call(step, spec, x, params, dt)
    params["squared_jerk_weight"].requires_grad_()  # no new version: the flag is looked at too
    with pytest.raises(ValueError, match="squared_jerk_weight: cost parameters take no gradient"):
        _call(step, spec, x, params, dt)


def test_weights_per_dof_are_kept_for_the_native_node(monkeypatch):
    """[D] weights (the same for every trajectory, an optimiser's usual call): after one checked
    call, the node takes the calls without a Python check, reading the kept [B, D] rows; the cost
    is the definitions' with the weights repeated per trajectory."""
    from tensorstep.runtime import validate

    spec = _spec("central")
    step = ts.load(spec)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    x, params, dt = _data(spec)
    per_dof = {k: v[0].clone() for k, v in params.items() if k.endswith("_weight") and "row" not in k}
    checks = []
    check_inputs = validate.check_inputs
    monkeypatch.setattr(validate, "check_inputs", lambda *a: checks.append(1) or check_inputs(*a))
    calls = []
    for _ in range(3):
        u = x["u"].clone().requires_grad_()
        P, cost = _call(step, spec, {**x, "u": u}, {**params, **per_dof}, dt)
        (P.sum() + cost.sum()).backward()
        calls.append((len(checks), cost.grad_fn.name(), cost.detach(), u.grad))
    assert [n for n, *_ in calls] == [1, 1, 1] and "NativeStep" in calls[2][1]
    B = x["u"].shape[0]
    _, expected = _reference(spec, x, {**params, **{k: w.expand(B, -1) for k, w in per_dof.items()}}, dt)
    for _, _, cost, grad in calls[1:]:
        np.testing.assert_allclose(cost.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
        torch.testing.assert_close(grad, calls[0][3], rtol=1e-13, atol=0)


@PATHS
def test_a_parameter_given_new_data_or_strides_is_read_and_checked_again(path):
    """Checked parameters are kept (by the native node, or the Python path's stamps) while each is
    the same tensor unchanged: new data under the same tensor (``.data =``, which keeps its
    version) or new strides in place make the call check it again, and the kernels read the new
    values."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = _loaded(spec, path)
    t = spec.costs.index(("squared", "jerk"))
    weight = params["squared_jerk_weight"]
    first = _call(step, spec, x, params, dt)[-1]
    _call(step, spec, x, params, dt)
    doubled = 2.0 * weight.detach()
    weight.data = -doubled
    with pytest.raises(ValueError, match="squared_jerk_weight: expected values >= 0"):
        _call(step, spec, x, params, dt)
    weight.data = doubled
    again = _call(step, spec, x, params, dt)[-1]
    torch.testing.assert_close(again[:, t], 2.0 * first[:, t], rtol=1e-12, atol=0)
    weight.as_strided_(weight.shape, (0, 1))  # every trajectory reads the first row now
    strided = _call(step, spec, x, params, dt)[-1]
    fresh = _call(ts.load(spec), spec, x, {**params, "squared_jerk_weight": weight.contiguous()}, dt)[-1]
    assert not torch.equal(strided[:, t], again[:, t])
    torch.testing.assert_close(strided, fresh, rtol=0, atol=0)


def test_a_limit_written_in_place_between_forward_and_backward_is_refused():
    """The kernels read a contiguous limit as given (not a copy): written in place after the
    forward, it no longer holds what the forward read, and the backward raises, as PyTorch does
    for any saved tensor written in place: on the Python path, on the native node when the call
    was checked in Python, and on the node when it read the parameters its slot kept (naming the
    keyword). The same values given back, and the next call is right again."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = ts.load(spec)
    limit = params["bound_velocity_limit"]
    expected = None
    for native, kept in ((None, False), (step.native, False), (step.native, True)):
        step.native = native
        if kept:
            _call(step, spec, x, params, dt)  # checked and kept; the next call reads the slot
        u = x["u"].clone().requires_grad_()
        ys = _call(step, spec, {**x, "u": u}, params, dt)
        assert ("NativeStep" in ys[-1].grad_fn.name()) == (native is not None)
        limit.mul_(1.0)  # a new version, the same values
        match = ("bound_velocity_limit: " if kept else "") + ".*modified by an inplace operation"
        with pytest.raises(RuntimeError, match=match):
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
        u = x["u"].clone().requires_grad_()
        ys = _call(step, spec, {**x, "u": u}, params, dt)
        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
        expected = u.grad if expected is None else expected
        torch.testing.assert_close(u.grad, expected, rtol=1e-13, atol=0)


@PATHS
def test_an_inference_tensor_parameter_is_checked_on_every_call(path):
    """An inference tensor has no version to tell an in-place write: it is checked on every call."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = _loaded(spec, path)
    expected = _call(step, spec, x, params, dt)[-1]
    with torch.inference_mode():
        margin = params["bound_velocity_margin"].clone()
    for _ in range(2):
        got = _call(step, spec, x, {**params, "bound_velocity_margin": margin}, dt)[-1]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with torch.inference_mode():
        margin.sub_(10.0)
    with pytest.raises(ValueError, match="bound_velocity_margin: expected values >= 0"):
        _call(step, spec, x, {**params, "bound_velocity_margin": margin}, dt)


def _changes(D: int) -> dict:
    """Each thing a kept parameter's stamp compares, changed alone where PyTorch allows it (``.data =``
    keeps the version), on the limit ``bound_velocity_limit`` [2, D] unless named: (change, what the
    next call does: the names it checks again, or the error it raises)."""
    name = "bound_velocity_limit"

    def data(p, _):
        p[name].data = p[name].detach().clone()

    def offset(p, _):  # the same values one element into a storage (which moves the data pointer)
        flat = p[name].detach().reshape(-1)
        p[name].data = torch.cat([flat[:1], flat])[1:].view(2, D)

    def another(p, _):  # a view: the same data, shape, strides and version (the view shares it)
        p[name] = p[name].view(2, D)

    def batch(p, x):  # two trajectories, [D] weights kept as [3, D] rows
        for k in x:
            x[k] = x[k][:2]
        p["squared_position_target"] = p["squared_position_target"][:2]

    return {
        "version": (lambda p, _: p[name].mul_(1.0), [name]),
        "data pointer": (data, [name]),
        "storage offset": (offset, [name]),
        "strides": (lambda p, _: setattr(p[name], "data", p[name].detach().as_strided((2, D), (0, 1))), [name]),
        "shape": (lambda p, _: setattr(p[name], "data", p[name].detach().as_strided((1, D), (D, 1))),
                  rf"{name}: expected shape \(2, {D}\), got shape \(1, {D}\)"),
        "dtype": (lambda p, _: setattr(p[name], "data", p[name].detach().view(torch.int64)),
                  f"{name}: expected dtype torch.float64"),
        # the same memory read as its negation (lower > upper then): only the negative bit differs
        "negative bit": (lambda p, _: setattr(p[name], "data", torch._neg_view(p[name].detach())),
                         f"{name}: lower > upper"),
        "requires_grad": (lambda p, _: p[name].requires_grad_(), f"{name}: cost parameters take no gradient"),
        "identity": (another, [name]),
        "batch size": (batch, ["every"]),
    }


@PATHS
@pytest.mark.parametrize("change", list(_changes(3)))
def test_each_thing_a_kept_parameter_can_change_is_seen_on_both_paths(path, change, monkeypatch):
    """The Python path's stamp (runtime/validate.py ``stamp``) and the native node's kept rows
    (``unchanged`` in runtime/native_node.cpp) compare the same things: a parameter kept by two
    calls, then changed in one of them alone (its version, data, storage offset, strides, shape,
    dtype, negative bit, requires_grad, which tensor it is, the batch it was kept for), is checked again (its
    values read anew: a fresh step's results) or refused with the argument checks' error, on the
    native node as on the Python path. (Its device cannot change on this CPU-only node: a tensor's
    ``.data`` keeps its device type.)"""
    from tensorstep.runtime import costs

    spec = _spec("central")
    x, params, dt = _data(spec)
    params = {k: v[0].clone() if k.endswith("_weight") and "row" not in k else v for k, v in params.items()}
    step = _loaded(spec, path)
    checked = []
    check = costs.check_parameter
    monkeypatch.setattr(costs, "check_parameter", lambda arg, t: checked.append(arg.name) or check(arg, t))
    every = sorted(k for k in params if k != "squared_position_target")
    for expected in (every, []):  # checked and kept (and taken by the native node)
        checked.clear()
        _call(step, spec, x, params, dt)
        assert sorted(checked) == expected
    make, outcome = _changes(spec.dof)[change]
    make(params, x)
    checked.clear()
    if isinstance(outcome, str):
        with pytest.raises((ValueError, TypeError), match=outcome):
            _call(step, spec, x, params, dt)
        return
    got = _call(step, spec, x, params, dt)
    assert sorted(checked) == (every if outcome == ["every"] else outcome)
    fresh = {k: v.detach().contiguous() for k, v in params.items()}
    for y, e in zip(got, _call(_loaded(spec, "python"), spec, x, fresh, dt)):
        torch.testing.assert_close(y, e, rtol=0, atol=0)


@PATHS
@pytest.mark.parametrize("name", ["u", "squared_jerk_weight", "bound_velocity_limit", "bound_velocity_margin",
                                  "squared_position_target"])
def test_a_negated_view_is_read_as_its_values(path, name):
    """An argument given as a negated view (``torch._neg_view``: memory holding its values negated,
    the negative bit set) is read as its values, as PyTorch's ops read it, on both paths, on the
    call that checks it and on the next, which takes it as kept: states and cost the definitions'
    (of the values), u's gradient reaches the view's base (the plain step plus the costs in PyTorch,
    on plain tensors of the same values)."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    Y, expected = _reference(spec, x, params, dt)
    plain = spec.replace(costs=(), outputs=None)
    u_ref = x["u"].clone().requires_grad_()
    states = _call(ts.load(plain), plain, {**x, "u": u_ref}, {}, dt)
    gen = torch.Generator().manual_seed(1)
    gP, gc = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in (Y[0].shape, expected.shape))
    ((states[0] * gP).sum() + (_torch_costs(spec, states, params, x) * gc).sum()).backward()

    given = {**x, **params}
    base = (-given[name]).clone()
    given[name] = torch._neg_view(base)
    assert given[name].is_neg() and torch.equal(given[name], {**x, **params}[name])
    step = _loaded(spec, path)
    for _ in range(2):
        u = (base if name == "u" else x["u"].clone()).detach().requires_grad_()
        view = torch._neg_view(u) if name == "u" else u
        P, cost = _call(step, spec, {**{k: given[k] for k in x}, "u": view}, {k: given[k] for k in params}, dt)
        assert ("NativeStep" in cost.grad_fn.name()) == (path == "native" and step.native is not None)
        np.testing.assert_allclose(P.detach().numpy(), Y[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(cost.detach().numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
        ((P * gP).sum() + (cost * gc).sum()).backward()
        torch.testing.assert_close(-u.grad if name == "u" else u.grad, u_ref.grad, rtol=1e-12, atol=1e-12)


def test_the_python_path_checks_each_parameter_once_while_it_is_passed_unchanged(monkeypatch):
    """On the Python path (every CUDA call) a parameter's values are checked when it is new or
    changed, not on each call that passes it unchanged; one written into, given new data, made to
    require grad or given for another batch size is checked again (naming the keyword), and
    another tensor in its place is checked; each call's results are a fresh step's."""
    from tensorstep.runtime import costs

    spec = _spec("central")
    x, params, dt = _data(spec)
    step = _loaded(spec, "python")
    checked = []
    check = costs.check_parameter
    monkeypatch.setattr(costs, "check_parameter", lambda arg, t: checked.append(arg.name) or check(arg, t))

    def calls(p, xs=x):
        expected = _call(_loaded(spec, "python"), spec, xs, p, dt)
        checked.clear()
        got = _call(step, spec, xs, p, dt)
        for y, e in zip(got, expected):
            torch.testing.assert_close(y, e, rtol=0, atol=0)
        return sorted(checked)

    every = sorted(k for k in params if k != "squared_position_target")  # the target is differentiable
    assert calls(params) == every
    assert calls(params) == []
    params["bound_velocity_margin"].mul_(2.0)
    assert calls(params) == ["bound_velocity_margin"]
    assert calls(params) == []
    params["squared_jerk_weight"].data = 2.0 * params["squared_jerk_weight"].detach()
    assert calls(params) == ["squared_jerk_weight"]
    params["bound_velocity_limit"] = params["bound_velocity_limit"].clone()
    assert calls(params) == ["bound_velocity_limit"]
    params["squared_jerk_weight"].requires_grad_()  # no new version: the flag is looked at too
    for _ in range(2):
        with pytest.raises(ValueError, match="squared_jerk_weight: cost parameters take no gradient"):
            _call(step, spec, x, params, dt)
    params["squared_jerk_weight"].requires_grad_(False)
    assert calls(params) == []  # as it was kept: its values passed and were not written since
    two = {k: v[:2] for k, v in x.items()}
    per_trajectory = ("squared_position_target", *(k for k in every if k.endswith("_weight") and "row" not in k))
    smaller = {k: v[:2].clone() if k in per_trajectory else v for k, v in params.items()}
    assert calls(smaller, two) == every  # another batch size: every parameter again
    assert calls(smaller, two) == []


@PATHS
def test_a_modules_parameters_and_buffers_are_checked_once_while_passed_unchanged(path, monkeypatch):
    """Cost parameters as a user's module holds them: weights as nn.Parameters that do not require
    grad, limits and margins as buffers, u as an nn.Parameter. Their values are checked on the
    first call, not on the next ones, which the native node takes without the Python checks where
    it is built; one written in place is checked again (a negative margin refused, naming it) and
    read anew; made to require grad, it is refused. Each call's results are a fresh step's."""
    from tensorstep.runtime import costs, validate

    spec = _spec("central")
    x, params, dt = _data(spec)
    module = torch.nn.Module()
    for k, v in params.items():
        if k.endswith("weight"):
            setattr(module, k, torch.nn.Parameter(v.clone(), requires_grad=False))
        elif k != "squared_position_target":  # the target is differentiable: passed as it is
            module.register_buffer(k, v.clone())
    given = {k: getattr(module, k, v) for k, v in params.items()}
    assert {type(v) for v in given.values()} == {torch.nn.Parameter, torch.Tensor}
    u = torch.nn.Parameter(x["u"].clone())
    step = _loaded(spec, path)
    checked, python = [], []
    check, check_inputs = costs.check_parameter, validate.check_inputs
    monkeypatch.setattr(costs, "check_parameter", lambda arg, t: checked.append(arg.name) or check(arg, t))
    monkeypatch.setattr(validate, "check_inputs", lambda *a, **k: python.append(1) or check_inputs(*a, **k))

    def calls() -> list[str]:
        plain = {k: v.detach().clone() for k, v in given.items()}
        expected = _call(_loaded(spec, "python"), spec, {**x, "u": u.detach().clone()}, plain, dt)
        checked.clear()
        python.clear()
        got = _call(step, spec, {**x, "u": u}, given, dt)
        for y, e in zip(got, expected):
            torch.testing.assert_close(y.detach(), e, rtol=0, atol=0)
        return sorted(checked) if python else ["(native node)"]

    every = sorted(k for k in params if k != "squared_position_target")
    unchanged = ["(native node)"] if path == "native" else []
    assert calls() == every
    assert calls() == unchanged
    module.squared_jerk_weight.mul_(2.0)
    assert calls() == ["squared_jerk_weight"]
    assert calls() == unchanged
    module.bound_velocity_margin.sub_(10.0)
    with pytest.raises(ValueError, match="bound_velocity_margin: expected values >= 0"):
        _call(step, spec, {**x, "u": u}, given, dt)
    module.bound_velocity_margin.add_(10.0)
    assert calls() == ["bound_velocity_margin"]
    assert calls() == unchanged
    module.bound_acceleration_weight.requires_grad_()
    with pytest.raises(ValueError, match="bound_acceleration_weight: cost parameters take no gradient"):
        _call(step, spec, {**x, "u": u}, given, dt)


@pytest.mark.parametrize("path", ["native", "python"])
def test_weights_per_dof_follow_the_batch_of_actions_given_as_a_parameter(path):
    """u as an nn.Parameter (as an optimiser holds it): a [D] weight passed
    unchanged gives [B, D] rows for each call's batch (rows kept for another batch would be read
    past their end), and the results are a fresh step's."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    params = {k: v[0].clone() if k.endswith("_weight") and "row" not in k else v for k, v in params.items()}
    step = _loaded(spec, path)
    for B in (2, 3, 1):
        xs = {k: v[:B] for k, v in x.items()}
        ps = {**params, "squared_position_target": params["squared_position_target"][:B]}
        expected = _call(_loaded(spec, "python"), spec, xs, ps, dt)
        got = _call(step, spec, {**xs, "u": torch.nn.Parameter(xs["u"].clone())}, ps, dt)
        for y, e in zip(got, expected):
            torch.testing.assert_close(y.detach(), e, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["central", "acceleration", "jerk_exact", "goal", "indexed_bdh",
                                  "bspline_goal_per_trajectory", "bdh_row_tiles", "jerk_exact_long"])
def test_cuda_kernels_run_on_the_host_match_c(case):
    """The CUDA source (run on the host, tests/cuda_on_host.py) gives the C kernels' states, cost
    and gradients: each column's term sums, then cost_sum's dof order. An integrator's CUDA adjoint
    recomputes its rows in segments (codegen/fused.py ``_recurrence``), C's in one pass; past H=100
    in float64 in longer segments (fewer checkpoints)."""
    from cuda_on_host import host_step

    spec = _spec(case, outputs=("P", "A"))
    x, params, dt = _data(spec)
    results = []
    for step in (ts.load(spec), host_step(spec)):
        u = x["u"].clone().requires_grad_()
        target = params["squared_position_target"].clone().requires_grad_()
        ys = _call(step, spec, {**x, "u": u}, {**params, "squared_position_target": target}, dt)
        sum(y.square().sum() for y in ys).backward()
        results.append([*(y.detach() for y in ys), u.grad, target.grad])
    for c, cuda in zip(*results):
        torch.testing.assert_close(cuda, c, rtol=1e-13, atol=1e-13 * float(c.abs().max()))


def test_cuda_row_tiles_with_no_output_written_run_on_the_host_match_c():
    """Layout "bdh" past a warp's whole rows with the cost alone written: the forward stages no rows
    (its tile array had no element, which nvcc refuses), and the host-run CUDA source gives C's cost
    and gradients."""
    from cuda_on_host import host_step

    spec = _spec("bdh_row_tiles", outputs=())
    assert "forward" in [kernel for kernel, *_ in generate(spec, targets=("cuda",)).launch_plan("cuda").tiles]
    x, params, dt = _data(spec)
    results = []
    for step in (ts.load(spec), host_step(spec)):
        u = x["u"].clone().requires_grad_()
        target = params["squared_position_target"].clone().requires_grad_()
        (cost,) = _call(step, spec, {**x, "u": u}, {**params, "squared_position_target": target}, dt)
        cost.square().sum().backward()
        results.append([cost.detach(), u.grad, target.grad])
    for c, cuda in zip(*results):
        torch.testing.assert_close(cuda, c, rtol=1e-13, atol=1e-13 * float(c.abs().max()))


@pytest.mark.parametrize("case", THREAD_COEFFICIENTS)
def test_cuda_coefficients_computed_by_each_thread_run_on_the_host_match_the_definitions(case):
    """The CUDA source run on the host (tests/cuda_on_host.py), its columns reading each monomial's
    factor from the block's copy in shared memory: P, cost and the gradients of u, p0 and the target
    against the plain step plus the terms from their definitions."""
    from cuda_on_host import host_step

    spec = _spec(case, outputs=("P",))
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, False, fused_step=host_step(spec))



@pytest.mark.parametrize("case", THREAD_COEFFICIENTS)
def test_cuda_float32_coefficients_computed_by_each_thread_run_on_the_host_match_the_definitions(case):
    """float32: the CUDA source run on the host, each coefficient a float product of the factor (the
    block's copy, rounded to float) and the thread's power of its dt rounded to float (its column of
    the block's shared powers): P, cost and the
    gradients of u, p0 and the target within 1e-6 of the largest (float32 rounding) of the plain float64
    step plus the terms from their definitions, on the values the kernel sees."""
    from cuda_on_host import host_step

    spec = _spec(case, outputs=("P",))
    x, params, dt = _data(spec)
    seen = lambda t: t.float().double() if t.is_floating_point() else t  # the values the kernel sees, exactly
    x, params, dt = ({k: seen(v) for k, v in x.items()}, {k: seen(v) for k, v in params.items()}, seen(dt))
    _fused_against_composite(spec, x, params, dt, False, fused_step=host_step(spec.replace(dtype="float32")),
                             fused_dtype=torch.float32, tol=1e-6)

#: CUDA's fused stencil columns are rolled at every horizon (run on the host), C's past fused.C_ROLL_ABOVE_H
ROLLED = [(case, horizon, True) for case, horizon in (
    ("central", 8), ("central", 33), ("central", 256), ("one_sided", 100), ("goal", 256), ("backward", 33),
    ("per_step", 100), ("indexed_bdh", 100), ("snap", 33), ("central_per_trajectory", 100), ("wide_per_step", 33),
    ("wide_per_step", 64))] + [
    (case, horizon, False) for case, horizon in (
        ("one_sided", 100), ("goal", 64), ("backward", 41), ("per_step", 100), ("indexed_bdh", 100), ("snap", 41),
        ("central_per_trajectory", 100))]


@pytest.mark.parametrize("case, horizon, cuda", ROLLED)
def test_rolled_stencil_columns_match_the_definitions(case, horizon, cuda):
    """A fused stencil's forward and adjoint with their interior steps one loop each (codegen/fused.py
    ``forward_rolled``, ``adjoint_rolled``), CUDA's run on the host (tests/cuda_on_host.py), C's past
    fused.C_ROLL_ABOVE_H: P, cost and the gradients of u, p0, the target (and dt, C's, where it has
    one) against the plain step plus the terms from their definitions, each boundary option."""
    from cuda_on_host import host_step

    spec = _spec(case).replace(horizon=horizon)
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, not cuda and spec.dt != "uniform",
                             fused_step=host_step(spec) if cuda else None)


def test_cuda_float32_rolled_stencil_columns_run_on_the_host_match_the_definitions():
    """The same in float32, within 1e-6 of the largest, on the values the kernel sees."""
    from cuda_on_host import host_step

    spec = _spec("central").replace(horizon=100)
    x, params, dt = _data(spec)
    seen = lambda t: t.float().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    x, params = {k: seen(v) for k, v in x.items()}, {k: seen(v) for k, v in params.items()}
    _fused_against_composite(spec, x, params, float(torch.tensor(dt).float()), False,
                             fused_step=host_step(spec.replace(dtype="float32")), fused_dtype=torch.float32, tol=1e-6)


def _states_and_grads(step, spec, x, params, dt, device: str = "cpu") -> list[torch.Tensor]:
    """The step's outputs and the gradients of u and the target from the sum of their squares, the
    float64 data in the spec's dtype on ``device``; the results in float64 on the host."""
    to = lambda t: (t.detach().to(device=device, dtype=getattr(torch, spec.dtype)) if t.is_floating_point()
                    else t.to(device))
    xs = {k: (tuple(to(g) for g in v) if isinstance(v, tuple) else to(v)) for k, v in x.items()}
    ps = {k: to(v) for k, v in params.items()}
    xs["u"].requires_grad_()
    ps["squared_position_target"].requires_grad_()
    ys = _call(step, spec, xs, ps, to(dt) if isinstance(dt, torch.Tensor) else dt)
    sum(y.square().sum() for y in ys).backward()
    return [t.detach().cpu().double() for t in (*ys, xs["u"].grad, ps["squared_position_target"].grad)]


def test_cuda_float32_checkpoints_run_on_the_host_match_c():
    """float32 CUDA checkpoints are indexed from a runtime 0 (kernel.cu.j2 ``TS_CK``): the CUDA source
    run on the host against the C kernels, a long recurrence with many checkpoints (float32 sums
    in another order on each side)."""
    from cuda_on_host import host_step

    spec = _spec("jerk_exact_long", outputs=("P", "A")).replace(dtype="float32")
    data = _data(spec)
    results = [_states_and_grads(step, spec, *data) for step in (ts.load(spec), host_step(spec))]
    for c, cuda in zip(*results):
        torch.testing.assert_close(cuda, c, rtol=2e-5, atol=2e-5 * float(c.abs().max()))


def _has_gpu() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and CuPy")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", ["central", "acceleration", "jerk_exact", "goal", "indexed_bdh",
                                  "bspline_goal_per_trajectory", "bdh_row_tiles", "snap"])
def test_gpu_fused_costs_match_the_cpu(case, dtype):
    """The fused kernels on the GPU against the C kernels: states, cost, and the gradients of u and
    the target, over several blocks (B=300). float32 sums in another order on each side."""
    spec = _spec(case, outputs=("P", "A")).replace(dtype=dtype)
    data = _data(spec, B=300)
    results = [_states_and_grads(ts.load(spec, device), spec, *data, device) for device in ("cpu", "cuda")]
    tol = 1e-12 if dtype == "float64" else 2e-5
    for c, gpu in zip(*results):
        torch.testing.assert_close(gpu, c, rtol=tol, atol=tol * float(c.abs().max()))


#: long shapes on the GPU (each also run on the host elsewhere in this file): rolled stencil and
#: recurrence columns, float32 checkpoints, a dt per step or per trajectory, the wide float64 adjoint
#: that keeps its scaled weights in shared memory (test_shared_column.py), and B-splines at 64 knots
#: (their knot loops; the float32 forwards are the ptxas grid's three that spill a few bytes); the
#: last three with every term (EVERY_TERM: both kinds on P, V, A and J), the others with TERMS
EVERY_TERM = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
    ("squared", s) for s in ("position", "velocity", "acceleration", "jerk"))
GPU_LONG = {
    "central_h256": dict(horizon=256, dof=3),
    "jerk_exact_h256": dict(horizon=256, dof=3, control="jerk", integrator="exact"),
    "velocity_per_step_h48": dict(horizon=48, dof=3, control="velocity", dt="per_step"),
    "acceleration_per_trajectory_h100": dict(horizon=100, dof=3, control="acceleration", dt="per_trajectory"),
    "wide_per_step_h64": dict(horizon=64, dof=7, difference="central", accuracy=8, order=4, dt="per_step",
                              costs=EVERY_TERM),
    "bspline_degree5_knots64": dict(control="bspline", degree=5, knots=64, steps=8, dof=7, costs=EVERY_TERM),
    "bspline_degree3_knots64_per_trajectory": dict(control="bspline", degree=3, knots=64, steps=4, dof=7,
                                                   dt="per_trajectory", costs=EVERY_TERM),
    # float64 order-4 recurrences whose reverse scan keeps two levels of checkpoints (codegen/roll.py
    # ``segmented``); an order-4 B-spline with a goal and row tiles, whose tile stores read the warp's n from
    # shared memory; a B-spline forward that reads its per-dof weights where they are used
    "velocity_order4_h200": dict(horizon=200, dof=7, control="velocity", dt="per_step", order=4),
    "velocity_exact_order4_h128_bdh": dict(horizon=128, dof=7, control="velocity", integrator="exact",
                                           dt="per_step", order=4, layout="bdh"),
    "bspline_degree4_knots8_goal_bdh": dict(control="bspline", degree=4, knots=8, steps=2, end="goal", dof=7,
                                            dt="per_trajectory", order=4, layout="bdh",
                                            costs=EVERY_TERM + (("bound", "snap"), ("squared", "snap"))),
    "bspline_degree5_knots32_order4": dict(control="bspline", degree=5, knots=32, steps=2, order=4, dof=7,
                                           costs=(("bound", "position"), ("bound", "velocity"), ("bound", "jerk"),
                                                  ("bound", "snap"), ("squared", "acceleration"),
                                                  ("squared", "position"), ("squared", "jerk"))),
}


@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and CuPy")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", GPU_LONG)
def test_gpu_fused_costs_at_long_shapes_match_the_cpu(case, dtype):
    """As above, at the shapes whose CUDA columns loop over rows or knot spans, keep checkpoints or
    keep values in shared memory. float32 recurrences and sums over hundreds of rows differ in their
    order of operations on each side, hence the looser float32 bound."""
    shape = dict(GPU_LONG[case])
    spec = ts.KernelSpec(dtype=dtype, costs=shape.pop("costs", TERMS), outputs=("P", "A"), **shape)
    data = _data(spec, B=300)
    results = [_states_and_grads(ts.load(spec, device), spec, *data, device) for device in ("cpu", "cuda")]
    tol = 1e-11 if dtype == "float64" else 1e-4
    for c, gpu in zip(*results):
        torch.testing.assert_close(gpu, c, rtol=tol, atol=tol * float(c.abs().max()))


def test_only_the_cost_can_be_written():
    """outputs=() with cost terms: the step returns the cost alone (an integrator too)."""
    spec = ts.KernelSpec(horizon=7, dof=2, dtype="float64", control="acceleration", costs=(("squared", "jerk"),),
                         outputs=())
    x, params, dt = _data(spec)
    (cost,) = _call(ts.load(spec), spec, x, params, dt)
    _, expected = _reference(spec, x, params, dt)
    np.testing.assert_allclose(cost.numpy(), expected, rtol=1e-12)


def test_missing_row_weights_and_margins_read_as_ones_and_zeros():
    """Row weights and margins are optional: missing, they are ones and zeros (the runtime passes
    those tensors, so the kernels read them without a test)."""
    spec = _spec("central")
    x, params, dt = _data(spec)
    step = ts.load(spec)
    bare = {k: v for k, v in params.items() if not k.endswith(("_row_weight", "_margin"))}
    explicit = dict(bare)
    for kind, state in spec.costs:
        explicit[f"{kind}_{state}_row_weight"] = torch.ones(spec.horizon, dtype=torch.float64)
        if kind == "bound":
            explicit[f"bound_{state}_margin"] = torch.zeros(spec.dof, dtype=torch.float64)
    for a, b in zip(_call(step, spec, x, bare, dt), _call(step, spec, x, explicit, dt)):
        assert torch.equal(a, b)
    _, expected = _reference(spec, x, bare, dt)
    np.testing.assert_allclose(_call(step, spec, x, bare, dt)[-1].numpy(), expected, rtol=1e-12)


FORM_RUN = """
import sys, torch, tensorstep as ts
spec, data = ts.KernelSpec.from_dict(eval(sys.argv[1])), torch.load(sys.argv[2])
x, params = data["x"], data["params"]
u = x["u"].clone().requires_grad_()
target = params["squared_position_target"].clone().requires_grad_()
outs = ts.load(spec)(u, x["p0"], x["v0"], x["a0"], 0.1, j0=x["j0"], **{**params, "squared_position_target": target})
torch.autograd.backward(outs, data["g"])
torch.save([*(y.detach() for y in outs), u.grad, target.grad], sys.argv[3])
"""


COLUMN_SHAPES = [("float32", 7, 9, "position"), ("float64", 7, 9, "position"), ("float32", 12, 9, "position"),
                 ("float32", 7, 41, "position"), ("float64", 4, 41, "position"), ("float32", 7, 41, "velocity"),
                 ("float64", 7, 41, "acceleration")]
FLOAT32_SHAPES, FLOAT64_SHAPES = ([s for s in COLUMN_SHAPES if s[0] == t] for t in ("float32", "float64"))
#: the vector lanes (GCC's vector types) at every shape; their intrinsics and the per-dof loop each at a
#: seeded float32 and float64 shape: the column's statements are the lanes' at every shape, and these two
#: forms change only the macros the statements are written in (per dtype), not which statements
COLUMN_FORMS = [(*shape, None) for shape in COLUMN_SHAPES] + [
    (*shape, form) for seed, form in ((7, "-DTS_LANE_INTRINSICS"), (8, "-DTS_NO_LANES"))
    for shape in sample(FLOAT32_SHAPES, 1, seed) + sample(FLOAT64_SHAPES, 1, seed)]
FORM_IDS = {None: "vector-lanes", "-DTS_LANE_INTRINSICS": "vector-lanes-immintrin", "-DTS_NO_LANES": "per-dof-loop"}


@pytest.mark.parametrize("dtype, dof, horizon, control, form", COLUMN_FORMS,
                         ids=[f"{t}-{d}-{h}-{c}-{FORM_IDS[f]}" for t, d, h, c, f in COLUMN_FORMS])
def test_column_forms_match_the_plain_step_plus_costs(dtype, dof, horizon, control, form, tmp_path):
    """The C kernels' column forms (all dof in one masked vector, AVX-512; the per-dof loop): states,
    cost and gradients against the plain step (float64) plus the terms from their definitions.
    Every kind, on P (with a target), V and J; in float32 the vector of the sums per dof is wider
    than the rows' (8 doubles), at D=12 two 512-bit vectors. At H=41 the columns are rolled
    (fused.C_ROLL_ABOVE_H; a recurrence's, fused.C_ROLL_RECURRENCE_ABOVE_H: its checkpoints T or VT)."""
    import os
    import subprocess
    import sys

    from helpers import require_avx512

    if form != "-DTS_NO_LANES":
        require_avx512()
    terms = (("bound", "position"), ("squared", "position"), ("bound", "velocity"), ("squared", "jerk"))
    spec = ts.KernelSpec(horizon=horizon, dof=dof, dtype=dtype, costs=terms, outputs=("P", "V"), control=control)
    x, params, _ = _data(spec)
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(3, horizon, dof, generator=gen, dtype=torch.float64),
         torch.randn(3, horizon, dof, generator=gen, dtype=torch.float64),
         torch.randn(3, len(terms), generator=gen, dtype=torch.float64))
    cast = (lambda t: t.float().double()) if dtype == "float32" else (lambda t: t)  # values the kernel sees exactly
    x, params, g = ({k: cast(v) for k, v in x.items()}, {k: cast(v) for k, v in params.items()}, tuple(cast(t) for t in g))
    to = (lambda t: t.float()) if dtype == "float32" else (lambda t: t)
    torch.save(dict(x={k: to(v) for k, v in x.items()}, params={k: to(v) for k, v in params.items()},
                    g=tuple(to(t) for t in g)), tmp_path / "in.pt")
    env = dict(os.environ)
    env["TENSORSTEP_CFLAGS"] = " ".join(f for f in (env.get("TENSORSTEP_CFLAGS", ""), form) if f)
    run = subprocess.run([sys.executable, "-c", FORM_RUN, repr(spec.to_dict()), str(tmp_path / "in.pt"),
                          str(tmp_path / "out.pt")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = torch.load(tmp_path / "out.pt")

    plain = ts.KernelSpec(horizon=horizon, dof=dof, dtype="float64", control=control)
    u = x["u"].clone().requires_grad_()
    target = params["squared_position_target"].clone().requires_grad_()
    states = ts.load(plain)(u, x["p0"], x["v0"], x["a0"], 0.1, j0=x["j0"])
    cost = _torch_costs(spec, states, {**params, "squared_position_target": target}, x)
    torch.autograd.backward((states[0], states[1], cost), g)
    tol = 1e-5 if dtype == "float32" else 1e-12
    pairs = [(got[0], states[0], "P"), (got[1], states[1], "V"), (got[3], u.grad, "u"), (got[4], target.grad, "target")]
    pairs += [(got[2][:, t], cost[:, t], f"cost {kind} {state}") for t, (kind, state) in enumerate(terms)]  # each term's scale
    for a, b, name in pairs:
        torch.testing.assert_close(a.double(), b.detach(), rtol=tol, atol=tol * float(b.detach().abs().max()), msg=name)


#: recurrences whose CUDA columns run their repeating steps as loops (codegen/fused.py ``forward_rolled``,
#: ``rolled_adjoint``): each integrator control, short (no two segments repeat: straight-line) to long,
#: with and without a squared position term (the target's gradient), a dt shared, per trajectory or per step
ROLLED = {f"{control}_h{H}{'_target' if target else ''}_{dt}": (control, H, target, dt)
          for control, H, target, dt in (("velocity", 8, True, "uniform"), ("acceleration", 8, False, "per_trajectory"),
                                          ("jerk", 33, False, "uniform"), ("velocity", 33, False, "per_trajectory"),
                                          ("acceleration", 33, True, "uniform"), ("jerk", 100, True, "per_trajectory"),
                                          ("velocity", 100, True, "uniform"), ("acceleration", 100, False, "uniform"),
                                          ("jerk", 256, True, "uniform"), ("velocity", 256, False, "per_trajectory"),
                                          ("acceleration", 256, True, "per_trajectory"),
                                          # a dt per step: the coefficient slots advance along the loops
                                          ("velocity", 48, True, "per_step"), ("jerk", 256, False, "per_step"))}


# the straight-line ones (H=8), the two with a dt per step, and per control a seeded one of its three rolled
# ones with a dt shared or per trajectory (all 13 under TENSORSTEP_FULL_SWEEP=1): a control's three run its
# one loop over segments, the horizon setting only how many segments it runs and recomputes (H=256 runs
# with a dt per step); the target's term and the dt kinds are the same statements whatever the control
ROLLED_LOOPS = {control: [case for case, (c, H, _, dt) in ROLLED.items() if c == control and H > 8 and dt != "per_step"]
                for control in ("velocity", "acceleration", "jerk")}
ROLLED_RUN = [case for case, (_, H, _, dt) in ROLLED.items() if H == 8 or dt == "per_step"] + [
    case for seed, cases in enumerate(ROLLED_LOOPS.values(), start=14) for case in sample(cases, 1, seed)]


@pytest.mark.parametrize("case", ROLLED_RUN)
def test_rolled_cuda_recurrences_run_on_the_host_match_the_definitions(case):
    """The CUDA source run on the host (tests/cuda_on_host.py), a recurrence's forward a loop over its
    steps and its adjoint a reverse scan over segments recomputed from checkpoints: P, the cost and the
    gradients of u, p0 (and the target) against the plain step plus the terms from their definitions."""
    from cuda_on_host import host_step

    control, H, target, dt = ROLLED[case]
    terms = TERMS if target else tuple(t for t in TERMS if t != ("squared", "position"))
    spec = ts.KernelSpec(horizon=H, dof=2, control=control, dt=dt, dtype="float64", costs=terms, outputs=("P",),
                         integrator="exact" if control == "jerk" else "semi_implicit_euler")
    x, params, dt_ = _data(spec)
    _fused_against_composite(spec, x, params, dt_, False, fused_step=host_step(spec))


#: recurrences whose rolled CUDA columns are checked further (bits, float32): one per integrator control
ROLLED_FURTHER = ["velocity_h33_per_trajectory", "jerk_h100_target_per_trajectory",
                  "acceleration_h256_target_per_trajectory"]


# a seeded one of the three: the rolled and the straight-line columns come from one generic lowering
# whatever the control (the recurrences' rolled columns run against the definitions above, every control)
@pytest.mark.parametrize("case", sample(ROLLED_FURTHER, 1, seed=1))
def test_rolled_cuda_recurrences_give_the_straight_line_columns_bits(case, monkeypatch):
    """The rolled CUDA forward and adjoint (run on the host) give the bits of the straight-line columns
    they replace (``fused.forward``, ``_recurrence`` in segments): the same statements, in the same order.
    float64 only: where the compiler contracts a product and a sum into one FMA may differ between a loop
    and a straight-line column (the host's -ffp-contract=fast, nvcc's fmad), which in float32 moved the
    forward's P by a few units in the last place; float32 is checked against the definitions below."""
    dtype = "float64"
    from cuda_on_host import host_step
    from tensorstep.codegen import driver, fused, lower

    control, H, target, dt = ROLLED[case]
    spec = ts.KernelSpec(horizon=H, dof=2, control=control, dt=dt, dtype=dtype, costs=TERMS, outputs=("P", "A"),
                         integrator="exact" if control == "jerk" else "semi_implicit_euler")
    data = _data(spec)
    source = lambda: generate(spec, targets=("cuda",), parts=("core",)).source("cuda", "core")
    rolled, rolled_source = _states_and_grads(host_step(spec), spec, *data), source()
    monkeypatch.setattr(fused, "forward_rolled", lambda op, coefs, refs, table, live, **_: fused.forward(
        op, coefs, refs, table, lower._forward_lines, live))
    monkeypatch.setattr(fused, "rolled_adjoint", lambda *args: None)
    driver.lowered.cache_clear()  # (its lowering, kept per spec, holds the rolled columns)
    straight, straight_source = _states_and_grads(host_step(spec), spec, *data), source()
    driver.lowered.cache_clear()
    assert "yb0_s0" in rolled_source and "yb0_s0" not in straight_source  # (a segment's adjoint of P)
    for a, b in zip(rolled, straight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ROLLED_FURTHER)
def test_rolled_cuda_float32_recurrences_run_on_the_host_match_the_definitions(case):
    """float32: the rolled CUDA columns run on the host, within 1e-6 of the largest (float32 rounding) of the
    plain float64 step plus the terms from their definitions, on the values the kernel sees."""
    from cuda_on_host import host_step

    control, H, target, dt = ROLLED[case]
    spec = ts.KernelSpec(horizon=H, dof=2, control=control, dt=dt, dtype="float64", costs=TERMS, outputs=("P",),
                         integrator="exact" if control == "jerk" else "semi_implicit_euler")
    x, params, dt_ = _data(spec)
    seen = lambda t: t.float().double() if t.is_floating_point() else t  # the values the kernel sees, exactly
    x, params, dt_ = ({k: seen(v) for k, v in x.items()}, {k: seen(v) for k, v in params.items()},
                      seen(dt_) if isinstance(dt_, torch.Tensor) else dt_)
    _fused_against_composite(spec, x, params, dt_, False, fused_step=host_step(spec.replace(dtype="float32")),
                             fused_dtype=torch.float32, tol=1e-6)


#: order-4 float64 recurrences whose CUDA reverse scan keeps few checkpoints (codegen/roll.py ``segmented``):
#: with a squared jerk term the acceleration is the one value kept a segment, the velocity (the action) read
#: again, position and jerk not read by a recomputed segment (one level of 2-step segments at H=128, a dt per
#: step: a segment recomputes 3 of a step's rows); jerk with every term keeps position, velocity and
#: acceleration, the jerk (the action) read again (two levels at H=200, the segments before the blocks one
#: shorter block)
FEW_CHECKPOINTS = {
    "velocity_h128_squared_jerk_per_step": dict(control="velocity", horizon=128, integrator="exact", dt="per_step",
                                                costs=(("squared", "jerk"),)),
    "jerk_h200_every_term_per_trajectory": dict(control="jerk", horizon=200, dt="per_trajectory", costs=tuple(
        (kind, state) for kind in ("bound", "squared") for state in STATES)),
}


@pytest.mark.parametrize("case", FEW_CHECKPOINTS)
def test_rolled_cuda_adjoints_with_few_checkpoints_run_on_the_host_match_the_definitions(case):
    """The CUDA source run on the host (tests/cuda_on_host.py), its adjoint's checkpoints only the values a
    recomputed segment reads and the actions read again: P, the cost and the gradients of u, p0 (and the
    target) against the plain step plus the terms from their definitions (float64, 1e-10)."""
    from cuda_on_host import host_step

    spec = ts.KernelSpec(dof=2, order=4, dtype="float64", outputs=("P",), **FEW_CHECKPOINTS[case])
    source = generate(spec, targets=("cuda",), parts=("core",)).source("cuda", "core")
    action = STATES.index(spec.control)
    assert "TS_CHECKPOINTS(" in source and f"const T y{action}_q1 = U(" in source  # (the action read again)
    x, params, dt_ = _data(spec)
    _fused_against_composite(spec, x, params, dt_, False, fused_step=host_step(spec))


#: CUDA checkpoint budgets (fused.CHECKPOINT_BYTES) below the default where no block of a recurrence's
#: segments fits (codegen/roll.py ``segmented``; tests/codegen/test_fused_roll.py sweeps them): jerk at H=48
#: in 3-step segments (2 by default) in two levels, 30 checkpoints of 8 bytes, a dt per step (its table
#: slots advancing by the longer segments); velocity at H=40 with 16 bytes, not two segments' checkpoints:
#: no scan, the straight-line column keeping none
SMALL_BUDGETS = {
    "jerk_h48_256_bytes_per_step": (dict(control="jerk", horizon=48, integrator="exact", dt="per_step"), 256, 30),
    "velocity_h40_16_bytes": (dict(control="velocity", horizon=40, integrator="semi_implicit_euler"), 16, None),
}


@pytest.mark.parametrize("case", SMALL_BUDGETS)
def test_cuda_adjoints_within_a_small_checkpoint_budget_run_on_the_host_match_the_definitions(case, monkeypatch):
    """The CUDA source run on the host (tests/cuda_on_host.py) with a checkpoint budget too small for blocks of
    the reverse scan's segments: longer segments, or none (the straight-line column), the checkpoint array
    within the budget either way; P, the cost and the gradients of u, p0 and the target against the plain
    step plus the terms from their definitions (float64, 1e-10)."""
    from cuda_on_host import host_step
    from tensorstep.codegen import driver

    fields, budget, checkpoints = SMALL_BUDGETS[case]
    spec = ts.KernelSpec(dof=2, dtype="float64", costs=TERMS, outputs=("P",), **fields)
    monkeypatch.setattr(fused, "CHECKPOINT_BYTES", budget)
    driver.lowered.cache_clear()  # (its lowering, kept per spec, holds the columns)
    try:
        source = generate(spec, targets=("cuda",), parts=("core",)).source("cuda", "core")
        array = re.search(r"TS_CHECKPOINTS\((\d+)\)", source)
        kept = int(array[1]) if array else None
        assert kept is None or kept * 8 <= budget, kept
        # (yb0_s0: a segment's adjoint of P, the scan's)
        assert (kept, "yb0_s0" in source) == (checkpoints, checkpoints is not None)
        x, params, dt_ = _data(spec)
        _fused_against_composite(spec, x, params, dt_, False, fused_step=host_step(spec))
    finally:
        driver.lowered.cache_clear()


#: C's fused recurrence columns are rolled past fused.C_ROLL_RECURRENCE_ABOVE_H (the forward one loop, the
#: adjoint a reverse scan over segments from checkpoints in a local array): each control, with and without a
#: squared position term (the target's gradient), a dt shared, per trajectory or per step, up to H=256
C_ROLLED = {f"{control}_h{H}{'_target' if target else ''}_{dt}": (control, H, target, dt)
            for control, H, target, dt in (("velocity", 41, True, "uniform"), ("acceleration", 41, False, "per_trajectory"),
                                            ("jerk", 41, True, "per_step"), ("velocity", 100, False, "per_trajectory"),
                                            ("acceleration", 100, True, "uniform"), ("jerk", 100, False, "uniform"),
                                            ("velocity", 256, True, "per_step"), ("acceleration", 256, False, "uniform"),
                                            ("jerk", 256, True, "per_trajectory"))}


# each control, horizon and dt mode once (all nine under TENSORSTEP_FULL_SWEEP=1): the rolled recurrence is
# one generic loop and scan whatever the control, and each of these three is the others' path at another shape
@pytest.mark.parametrize("case", list(C_ROLLED) if FULL else ["jerk_h41_target_per_step", "velocity_h100_per_trajectory",
                                                              "acceleration_h256_uniform"])
def test_rolled_c_recurrences_match_the_definitions(case):
    """C's fused recurrence past fused.C_ROLL_RECURRENCE_ABOVE_H (codegen/lower.py ``c_recurrence_rolled``): P, the
    cost and the gradients of u, p0, the target (and dt where it has one per trajectory or per step) against the
    plain step plus the terms from their definitions (float64, 1e-10)."""
    from tensorstep.codegen import fused

    control, H, target, dt = C_ROLLED[case]
    assert H > fused.C_ROLL_RECURRENCE_ABOVE_H
    terms = TERMS if target else tuple(t for t in TERMS if t != ("squared", "position"))
    spec = ts.KernelSpec(horizon=H, dof=2, control=control, dt=dt, dtype="float64", costs=terms, outputs=("P",),
                         integrator="exact" if control == "jerk" else "semi_implicit_euler")
    assert "TS_CK(" in generate(spec, ("c",), ("core",)).source("c", "core")  # (the scan's checkpoints)
    x, params, dt_ = _data(spec)
    _fused_against_composite(spec, x, params, dt_, dt != "uniform")


#: C's rolled float32 forwards past the thresholds: each control, runs of 16 ending at the column's end
#: (H=48) and a last run cut short (41, 100), a dt per trajectory or per step
C_ROLLED_FLOAT32 = {f"{control}_h{H}_{dt}": (control, H, dt) for control, H, dt in (
    ("position", 48, "uniform"), ("position", 100, "per_step"), ("velocity", 41, "per_trajectory"),
    ("acceleration", 64, "uniform"), ("jerk", 100, "per_step"))}


@pytest.mark.parametrize("case", C_ROLLED_FLOAT32)
def test_rolled_c_float32_columns_match_the_definitions(case):
    """C's float32 columns past the thresholds (the forward's terms in float runs, codegen/fused.py
    ``_run_ends``): P, the cost and the gradients of u, p0 and the target within 1e-6 of the largest of
    the plain float64 step plus the terms from their definitions, on the values the kernel sees."""
    control, H, dt = C_ROLLED_FLOAT32[case]
    spec = ts.KernelSpec(horizon=H, dof=3, control=control, dt=dt, dtype="float64", costs=TERMS, outputs=("P",),
                         integrator="exact" if control == "jerk" else "semi_implicit_euler")
    x, params, dt_ = _data(spec)
    seen = lambda t: t.float().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    x, params, dt_ = {k: seen(v) for k, v in x.items()}, {k: seen(v) for k, v in params.items()}, seen(dt_)
    _fused_against_composite(spec, x, params, dt_, False, fused_step=ts.load(spec.replace(dtype="float32")),
                             fused_dtype=torch.float32, tol=1e-6)


#: one variant's forward in a process of its own (argv: spec, inputs, output, "straight" for the
#: straight-line columns at any horizon, else the columns the thresholds choose)
ROLL_RUN = """
import sys, torch, tensorstep as ts
from tensorstep.codegen import fused
from tensorstep.codegen.driver import generate
if sys.argv[4] == "straight":
    fused.C_ROLL_ABOVE_H = fused.C_ROLL_RECURRENCE_ABOVE_H = 10 ** 6
spec, data = ts.KernelSpec.from_dict(eval(sys.argv[1])), torch.load(sys.argv[2])
source = generate(spec, ("c",), ("core",)).source("c", "core")
x, params = data["x"], data["params"]
with torch.no_grad():
    outs = ts.load(spec)(x["u"], x["p0"], x["v0"], x["a0"], data["dt"], j0=x["j0"], **params)
# (a loop over runs of 16 steps, or a knot span's rows each testing whether it ends a run)
torch.save([*outs, "rs += 16" in source or "% 16 == 15" in source], sys.argv[3])
"""

#: C's rolled float32 forwards: stencils, recurrences, and B-splines whose runs of 16 rows cross their
#: knot spans (3 rows a span; 4 rows, degree 5; 8 rows, degree 4)
ROLLED_FLOAT32_BITS = {"position_h48": dict(horizon=48), "velocity_h41": dict(horizon=41, control="velocity"),
                       "jerk_h64": dict(horizon=64, control="jerk", integrator="exact"),
                       "bspline_p3_n12_s3": dict(control="bspline", degree=3, knots=12, steps=3),
                       "bspline_p5_n10_s4": dict(control="bspline", degree=5, knots=10, steps=4),
                       "bspline_p4_n8_s8": dict(control="bspline", degree=4, knots=8, steps=8)}


# the stencil, and a seeded one of the recurrences and of the B-splines (all six under TENSORSTEP_FULL_SWEEP=1):
# within a family the rolled forward is the same loop over float runs (a B-spline's steps test where a run
# ends whatever their rows a span), the shapes differ only in where the runs end; the rolled float32 stencil
# and recurrence columns also run against the definitions (test_rolled_c_float32_columns_match_the_definitions)
@pytest.mark.parametrize("case", ["position_h48", *sample(["velocity_h41", "jerk_h64"], 1, seed=2),
                                  *sample(["bspline_p3_n12_s3", "bspline_p5_n10_s4", "bspline_p4_n8_s8"], 1, seed=3)])
def test_rolled_c_float32_forwards_give_the_straight_line_bits(case, tmp_path):
    """A rolled float32 forward adds each term's rows in the straight-line form's runs and order (runs of
    fused.FLOAT_RUN_ROWS in float from the column's first row, each into the term's double sum; a
    B-spline's across its knot spans): P and the cost are the straight-line columns' bits, the two
    built in processes of their own (the thresholds patched in one), with ``-ffp-contract=off``. With
    contraction the compiler may fuse another product of a run's first two rows into an FMA in each
    form (a rounding of a row apart); without it the C source's arithmetic is what either form runs."""
    spec = ts.KernelSpec(dof=3, dtype="float32", costs=TERMS, outputs=("P",), **ROLLED_FLOAT32_BITS[case])
    assert spec.horizon > fused.C_ROLL_ABOVE_H
    x, params, _ = _data(spec.replace(dtype="float64"), B=70)
    f32 = lambda t: t.float() if t.is_floating_point() else t
    torch.save(dict(x={k: f32(v) for k, v in x.items()}, params={k: f32(v) for k, v in params.items()},
                    dt=0.1), tmp_path / "in.pt")
    runs = {}
    for variant in ("straight", "rolled"):
        flags = " ".join(f for f in (os.environ.get("TENSORSTEP_CFLAGS", ""), "-ffp-contract=off") if f)
        env = dict(os.environ, TENSORSTEP_CACHE_DIR=str(tmp_path / variant), TENSORSTEP_CFLAGS=flags)
        run = subprocess.run([sys.executable, "-c", ROLL_RUN, repr(spec.to_dict()), str(tmp_path / "in.pt"),
                              str(tmp_path / f"{variant}.pt"), variant], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        runs[variant] = torch.load(tmp_path / f"{variant}.pt")
    assert [runs["straight"][-1], runs["rolled"][-1]] == [False, True]  # (a loop over runs in the rolled one only)
    for straight, rolled, name in zip(runs["straight"][:-1], runs["rolled"][:-1], ("P", "cost")):
        assert torch.equal(straight, rolled), name


#: fused B-splines: the columns group the rows by knot span, the interior spans one loop over the
#: knots (codegen/fused.py ``Blocks``), CUDA's (run on the host) at a few knot counts, C's past
#: fused.C_ROLL_ABOVE_H rows (43 and 73 here)
ROLLED_BSPLINES = [(case, knots, True) for case, knots_of in (
    ("bspline", (8, 16)), ("bspline_goal_per_trajectory", (8, 20)), ("bspline_degree5_per_trajectory", (12,)))
    for knots in knots_of] + [("bspline", 16, False), ("bspline_goal_per_trajectory", 20, False)]


@pytest.mark.parametrize("case, knots, cuda", ROLLED_BSPLINES)
def test_rolled_bspline_columns_match_the_definitions(case, knots, cuda):
    """A fused B-spline's forward and adjoint with their interior knot spans one loop each, CUDA's
    run on the host (tests/cuda_on_host.py): P, cost and the gradients of u, p0, the target (and
    dt, C's, where it has one) against the plain step plus the terms from their definitions, dt
    shared and per trajectory."""
    from cuda_on_host import host_step

    spec = _spec(case).replace(knots=knots, horizon=None)
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, not cuda and spec.dt != "uniform",
                             fused_step=host_step(spec) if cuda else None)


#: B-splines whose rolled C adjoint with the bench's seven terms (dof 7) is longer in all than 1,000 lines
#: (codegen/render.py ``LANE_MAX_LINES`` when it was written), its first spans, knot loop and last spans each within it
LANE_ROLLED_BSPLINES = [(5, 10, 4)]


def _batch_functions(source: str) -> dict[str, str]:
    """A C source's batch functions by name, each with the text up to the next one."""
    pieces = source.split("TS_BATCH_FUNCTION void ")[1:]
    return {piece.split("(")[0]: piece for piece in pieces}


@pytest.mark.parametrize("degree, knots, steps", LANE_ROLLED_BSPLINES)
def test_long_rolled_bspline_adjoints_run_the_lane_form_and_match_the_definitions(degree, knots, steps):
    """A rolled B-spline adjoint too long in all for the lane form's straight-line limit, but whose
    stretches outside its knot loop are each within it (codegen/roll.py ``longest_stretch``), has the
    lane form in every C form, as the forwards do (where it ran the per-dof loop, 1.4-1.5x the
    straight-line columns' time at degree 5); float64 P, cost and the gradients of u and p0 of it and
    of the straight-line columns (the threshold patched) within 1e-12 of the largest of the plain step
    plus the terms from their definitions."""
    from tensorstep.bench.costs import TERMS as BENCH_SEVEN
    from tensorstep.codegen import driver
    from tensorstep.runtime.api import Step
    from tensorstep.runtime.launch import CpuBackend, Launcher

    spec = ts.KernelSpec(control="bspline", degree=degree, knots=knots, steps=steps, dof=7, dtype="float64",
                         costs=BENCH_SEVEN, outputs=("P",))
    assert spec.horizon > fused.C_ROLL_ABOVE_H
    functions = _batch_functions(generate(spec, ("c",), ("core",)).source("c", "core"))
    adjoints = [name for name in functions if "_adjoint" in name]
    assert len(adjoints) == 1 + len(fused.forms(argument_table(spec)))
    assert all("defined(TS_LANES)" in functions[name] for name in functions)
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, False, tol=1e-12)
    saved = fused.C_ROLL_ABOVE_H
    try:
        fused.C_ROLL_ABOVE_H = 10 ** 6
        driver.lowered.cache_clear()  # (the lowered operator keeps its columns)
        g = generate(spec, ("c",), ("core",))
        source = g.source("c", "core")
        assert "for (int64_t kn = " not in source
        straight = Step(spec, torch.device("cpu"), Launcher(spec, CpuBackend(spec, source, dict(g.metadata))))
    finally:
        fused.C_ROLL_ABOVE_H = saved
        driver.lowered.cache_clear()
    _fused_against_composite(spec, x, params, dt, False, fused_step=straight, tol=1e-12)


#: fused columns whose longest straight-line stretch (codegen/roll.py ``longest_stretch``) passes 1,000 lines,
#: the limit before ``LANE_MAX_LINES`` was set by gcc's time (BENCHMARKS.md, issue 39, "C's lane form past
#: 1,000 lines"), with their stretch: a rolled B-spline adjoint's first spans (degree 7, 4 rows a span), a
#: straight-line one's (3 rows a span: too few knots for a loop), and a straight-line stencil's (H=40, the eight
#: bound and squared terms on P, V, A, J)
PAST_OLD_LANE_LIMIT = {
    "bspline_rolled": (dict(control="bspline", degree=7, knots=14, steps=4), 1190),
    "bspline_straight": (dict(control="bspline", degree=3, knots=6, steps=6), 1392),
    "position_straight": (dict(horizon=40), 1033),
}


def _dense_reference(spec, x, params, dt, wP, wcost):
    """P [B, H, D], cost [B, T] and the gradients of Σ wP·P + Σ wcost·cost with respect to u and p0, in
    float64 NumPy: the states from the dense references (a B-spline's from tests/reference_bspline.py,
    SciPy; a stencil's from tests/reference.py), the terms and their slopes from their definitions
    (tests/reference_costs.py)."""
    from reference_bspline import trajectory

    B, D = x["u"].shape[0], spec.dof
    starts = [x[n].numpy() for n in ("p0", "v0", "a0", "j0")]
    plain = spec.replace(costs=(), outputs=None)
    if spec.control == "bspline":
        jacobians = [trajectory(x["u"].numpy()[b], [s[b] for s in starts], None, spec.degree, spec.steps, dt)
                     for b in range(B)]
        M_u, M_s = jacobians[0].jac_knots, jacobians[0].jac_start  # [4, H, N], [4, H, 4]: the same for every b
    else:
        M_u, M_s = reference.matrices(plain, dt)
    start = np.stack(starts, axis=1)  # [B, 4, D]
    Y = np.einsum("khn,bnd->kbhd", M_u, x["u"].numpy()) + np.einsum("khm,bmd->kbhd", M_s, start)
    named = {k: v.numpy() for k, v in params.items()}
    cost = reference_costs.costs(spec.costs, {STATES[k]: Y[k] for k in range(len(Y))}, named)
    G = np.zeros_like(Y)  # d (Σ wP·P + Σ wcost·cost) / d Y
    G[0] += wP.numpy()
    for t, (kind, state) in enumerate(spec.costs):
        k = STATES.index(state)
        w = wcost.numpy()[:, t, None, None] * named[f"{kind}_{state}_weight"][:, None, :] * \
            named[f"{kind}_{state}_row_weight"][None, :, None]
        if kind == "squared":
            target = named["squared_position_target"][:, None, :] if state == "position" else 0.0
            G[k] += 2 * w * (Y[k] - target)
        else:
            (lower, upper), m = named[f"bound_{state}_limit"], named[f"bound_{state}_margin"]
            G[k] += 2 * w * (np.maximum(0.0, Y[k] - (upper - m)) - np.maximum(0.0, (lower + m) - Y[k]))
    return Y[0], cost, np.einsum("khn,kbhd->bnd", M_u, G), np.einsum("kh,kbhd->bd", M_s[:, :, 0], G)


@pytest.mark.parametrize("case", PAST_OLD_LANE_LIMIT)
def test_columns_past_the_old_lane_limit_run_the_lane_form_and_match_the_dense_references(case):
    """A fused column whose longest stretch passes the old limit of 1,000 lines but is within
    ``LANE_MAX_LINES`` has the lane form in every batch function of its C source, every form (where it
    ran the per-dof loop: its adjoint 2.6-8x the lane form's time, gcc's 2-5x); float64 P, cost and the gradients of u and
    p0 within 1e-12 of the largest of the dense references'."""
    from tensorstep.bench.costs import TERMS as BENCH_SEVEN
    from tensorstep.codegen import driver, macros, roll
    from tensorstep.codegen.printer import lane_printer

    fields, stretch = PAST_OLD_LANE_LIMIT[case]
    spec = ts.KernelSpec(dof=7, dtype="float64", costs=EVERY_TERM if case.startswith("position") else BENCH_SEVEN,
                         outputs=("P",), **fields)
    code = driver.lowered(spec)
    printer = lane_printer(macros.lane_names(code.arguments))
    assert roll.longest_stretch(code.c_fused("adjoint", 8).statements, printer.lines) == stretch
    assert 1000 < stretch <= render.LANE_MAX_LINES
    functions = _batch_functions(generate(spec, ("c",), ("core",)).source("c", "core"))
    assert len([name for name in functions if "_adjoint" in name]) == 1 + len(fused.forms(argument_table(spec)))
    assert all("defined(TS_LANES)" in functions[name] for name in functions)
    x, params, dt = _data(spec)
    gen = torch.Generator().manual_seed(5)
    wP = torch.randn(3, spec.horizon, spec.dof, generator=gen, dtype=torch.float64)
    wcost = torch.randn(3, len(spec.costs), generator=gen, dtype=torch.float64)
    leaves = dict(u=x["u"].clone().requires_grad_(), p0=x["p0"].clone().requires_grad_())
    P, cost = _call(ts.load(spec), spec, {**x, **leaves}, params, dt)
    ((P * wP).sum() + (cost * wcost).sum()).backward()
    expected = _dense_reference(spec, x, params, dt, wP, wcost)
    for got, want in zip((P, cost, leaves["u"].grad, leaves["p0"].grad), expected):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=0, atol=1e-12 * np.abs(want).max())


#: the bench's seven terms and a target (the rows of tests/cuda/test_ptxas.py's B-splines): a span's
#: rows add to the actions' and the start state's partial sums row by row, the row weights read where
#: used (codegen/fused.py ``_span_partials``, ``_column_partials``, ``volatile_reads``)
BENCH_TERMS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
    ("squared", s) for s in ("velocity", "acceleration", "jerk", "position"))
#: with a dt per trajectory the columns' factors are the block's copy of those they read
#: (codegen/render.py ``factors_read``: 290 of the 5,146 slots of degree 3, 24 knots, 8 steps)
BENCH_BSPLINES = [(3, 64, 8, "uniform"), (3, 64, 4, "uniform"), (4, 16, 8, "per_trajectory"), (5, 16, 1, "uniform"),
                  (5, 20, 4, "per_trajectory"), (3, 24, 8, "per_trajectory")]


# a seeded one with a dt shared and one with a dt per trajectory (the columns copy the factors they read):
# the rolled span loops are one generic form at any degree, knots and rows a span
@pytest.mark.parametrize("degree, knots, steps, dt", sample(BENCH_BSPLINES[:2] + BENCH_BSPLINES[3:4], 1, seed=4)
                         + sample(BENCH_BSPLINES[2:3] + BENCH_BSPLINES[4:], 1, seed=5))
def test_rolled_bspline_columns_with_the_bench_terms_run_on_the_host_match_the_definitions(degree, knots, steps, dt):
    """CUDA's rolled B-spline columns with the bench's terms, run on the host: P, cost and the
    gradients of u, p0 and the target against the plain step plus the terms from their definitions."""
    from cuda_on_host import host_step

    spec = ts.KernelSpec(control="bspline", degree=degree, knots=knots, steps=steps, dof=2, dt=dt, dtype="float64",
                         costs=BENCH_TERMS, outputs=("P",))
    x, params, dt_ = _data(spec)
    _fused_against_composite(spec, x, params, dt_, False, fused_step=host_step(spec))


def test_cuda_adjoint_weights_in_shared_memory_run_on_the_host_match_the_definitions():
    """Where codegen/targets.py ``cuda_shared_column`` applies (tests/codegen/test_shared_column.py),
    CUDA's fused float64 adjoint reads its scaled weights from the thread's column of shared memory
    (the wide stencil at H=64, a target: its loop reads 32 values defined before it): the source has
    the slots, and run on the host (tests/cuda_on_host.py) P, cost and the gradients of u, p0 and
    the target match the plain step plus the terms from their definitions."""
    from cuda_on_host import host_step

    spec = _spec("wide_per_step", terms=BENCH_TERMS).replace(horizon=64)
    source = ts.source(spec, "cuda")
    assert "TS_CGW(0) = " in source and "double cacc0 = " in source
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, False, fused_step=host_step(spec))


def test_cuda_fused_forward_reads_its_late_inputs_where_used_and_matches_the_definitions():
    """CUDA's fused forward reads the inputs it uses only at its end where it first uses them
    (codegen/fused.py ``inputs_where_used``): each term's per-dof weight just before the column's sum
    is scaled, a goal's state after the knots' loop, each through a volatile read (loaded first they
    held registers through the column: spills at the cap). An order-4 B-spline with a goal, a dt per
    trajectory, bounds and squares (a target), run on the host: P, cost and the gradients of u, p0 and the
    target against the plain step plus the terms from their definitions. C's forward keeps them first."""
    from cuda_on_host import host_step

    terms = (("bound", "velocity"), ("bound", "snap"), ("squared", "position"), ("squared", "jerk"))
    spec = ts.KernelSpec(control="bspline", degree=3, knots=8, steps=2, end="goal", dt="per_trajectory", order=4,
                         dof=2, dtype="float64", costs=terms, outputs=("P",))
    source = ts.source(spec, "cuda")
    forward = source[source.index(f"{spec.name}_forward(int64_t B"):source.index(f"{spec.name}_adjoint(int64_t B")]
    loop = forward.index("for (int64_t kn")
    for t in range(len(terms)):
        read = f"const T cw{t} = (*(volatile const T*)&(CW{t}));"
        assert forward.count(read) == 1 and forward.index(read) > loop, t
    for i in range(3):  # (the goal's jerk may be absent: no lvalue, read first)
        assert forward.index(f"const T e{i} = (*(volatile const T*)&(E{i}));") > loop, i
    assert "volatile const T*)&(CW0)" not in ts.source(spec, "c")
    x, params, dt = _data(spec)
    _fused_against_composite(spec, x, params, dt, False, fused_step=host_step(spec))


def test_cuda_float32_bspline_forward_with_its_spans_fenced_runs_on_the_host_and_matches_the_definitions():
    """CUDA's fused float32 B-spline forward fences its first and last spans every two rows
    (codegen/fences.py ``rows_fenced``, ``TS_FENCE();``: at the 128 cap they spilled unfenced; on the
    host a fence is nothing). The bench's terms and a target, run on the host: P, cost and the gradients of u, p0 and
    the target within 1e-6 of the largest (float32 rounding) of the plain float64 step plus the terms
    from their definitions, on the values the kernel sees."""
    from cuda_on_host import host_step

    spec = ts.KernelSpec(control="bspline", degree=3, knots=12, steps=4, dof=2, dtype="float64", costs=BENCH_TERMS,
                         outputs=("P",))
    single = spec.replace(dtype="float32")
    source = ts.source(single, "cuda")
    forward = source[source.index(f"{single.name}_forward(int64_t B"):source.index(f"{single.name}_adjoint(int64_t B")]
    loop = forward.index("for (int64_t kn")
    assert forward.index("TS_FENCE();") < loop < forward.rindex("TS_FENCE();") and forward.count("TS_FENCE();") >= 6
    x, params, dt = _data(spec)
    seen = lambda t: t.float().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    x, params = {k: seen(v) for k, v in x.items()}, {k: seen(v) for k, v in params.items()}
    _fused_against_composite(spec, x, params, float(torch.tensor(dt).float()), False, fused_step=host_step(single),
                             fused_dtype=torch.float32, tol=1e-6)


def test_cuda_bspline_adjoint_with_row_tiles_and_row_by_row_start_and_goal_sums_matches_the_definitions():
    """A fused float64 order-4 B-spline with a goal and nine terms, layout "bdh" (issue 39's adjoint
    that spilled 168 bytes, at 2 dof): its adjoint adds each row's term to the start state's and the
    goal's gradient sums as the row is done (codegen/fused.py ``_span_column_partials``: no span's
    chain of partials, ``gc<k>_<i>``), and stores u's gradient through row tiles in a fixed count of
    stores, the lane read where a tile is stored (templates/kernel.cu.j2). Run on the host
    (tests/cuda_on_host.py; 3 trajectories: one partial warp of 6 lanes): the cost and the gradients
    of u, the start state, the goal and the target within 1e-10 of the plain step plus the terms
    from their definitions."""
    terms = tuple(("bound", s) for s in STATES) + tuple(("squared", s) for s in ("position", "acceleration", "jerk", "snap"))
    spec = ts.KernelSpec(control="bspline", degree=4, knots=8, steps=2, end="goal", dt="per_trajectory", order=4,
                         layout="bdh", dof=2, dtype="float64", costs=terms, outputs=())
    source = ts.source(spec, "cuda")
    adjoint = source[source.index(f"{spec.name}_adjoint(int64_t B"):]
    assert "ts_tile ts_t0" in adjoint and "TS_TILE_LANE()" in source and "ts_tile_lane()" in source
    assert re.search(r"for \(int k = 0; k < \d+; \+\+k\)", source)
    # the warp's n and first column are read where a tile is stored, not held in the tile (the host
    # run reads n from the same shared array)
    start = source.index("void ts_tile_store_")
    store = source[start:source.index("ts_tile_at_", start)]
    assert "TS_TILE_N()" in store and "TS_TILE_FIRST()" in store and "t->n" not in store
    # each power of the trajectory's dt kept as computed, not computed again from dt where used
    assert "TS_MONO_KEEP(ts_pw[ts_e])" in source and 'asm volatile("" : "+d"(v))' in source
    assert "ts_tile_ns[threadIdx.x >> 5] = n;" in adjoint and "first * " not in adjoint.split("ts_tile ts_t0")[1].split(";")[0]
    assert not re.search(r"\bgc\d+_\d+", adjoint)
    assert adjoint.count("as0 += ") > 2 and adjoint.count("ae0 += ") > 2
    _host_goal_step_against_the_definitions(spec, seed=5)


def _host_goal_step_against_the_definitions(spec, seed: int) -> None:
    """``spec``'s CUDA kernels run on the host (3 trajectories, a goal, a squared position term): the
    cost and the gradients of u, the start state, the goal and the target within 1e-10 of the plain
    step plus the terms from their definitions, under a random weighting of the cost's terms."""
    from cuda_on_host import host_step

    x, params, dt = _data(spec)
    gen = torch.Generator().manual_seed(seed)
    wcost = torch.randn(3, len(spec.costs), generator=gen, dtype=torch.float64)
    grads = []
    for fused_step in (True, False):
        leaves = {k: x[k].clone().requires_grad_() for k in ("u", "p0", "v0", "a0", "j0")}
        goal = tuple(g.clone().requires_grad_() for g in x["goal"])
        target = params["squared_position_target"].clone().requires_grad_()
        xx, pp = {**x, **leaves, "goal": goal}, {**params, "squared_position_target": target}
        if fused_step:
            out = _call(host_step(spec), spec, xx, pp, dt)
            cost = out[-1] if isinstance(out, tuple) else out
        else:
            plain = spec.replace(costs=(), outputs=None)
            cost = _torch_costs(spec, _call(ts.load(plain), plain, xx, {}, dt), pp, xx)
        (cost * wcost).sum().backward()
        grads.append([cost.detach()] + [t.grad for t in (*leaves.values(), *goal, target)])
    for got, expected in zip(*grads):
        assert got is not None and expected is not None and expected.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))


def test_cuda_bspline_adjoint_works_out_its_column_again_after_the_knots_loop_and_matches_the_definitions():
    """A fused float64 order-4 B-spline adjoint with a goal (the form of issue 39's that spilled 4 and
    12 bytes, here at 2 dof, 8 knots, three terms, with start and goal indices): after
    its knots' loop it works out the thread's column, the rows its indices pick and its bases again
    (codegen/fused.py ``column_again``: ``TS_COLUMN_AGAIN``), not holding them through the loop. Run
    on the host (tests/cuda_on_host.py, 3 trajectories): the cost and the gradients of u, the start
    state, the goal and the target within 1e-10 of the plain step plus the terms from their definitions."""
    terms = (("bound", "position"), ("squared", "position"), ("squared", "snap"))
    spec = ts.KernelSpec(control="bspline", degree=4, knots=8, steps=2, end="goal", dt="per_trajectory", order=4,
                         dof=2, dtype="float64", costs=terms, outputs=(), start_index=True, goal_index=True)
    source = ts.source(spec, "cuda")
    adjoint = source[source.index(f"{spec.name}_adjoint(int64_t B"):]
    after = adjoint[adjoint.index("for (int64_t kn"):]
    # once, after the knots' loop (its closing brace first), to the column's end; the forward keeps its form
    assert adjoint.count("TS_COLUMN_AGAIN();") == 1 and after.index("}") < after.index("TS_COLUMN_AGAIN();")
    assert after.index("TS_COLUMN_AGAIN_END();") > after.index("GE0(")
    assert "const int64_t grow = gidx ? gidx[b] : b;" in source.split("#define TS_COLUMN_AGAIN()")[1]
    forward = source[source.index(f"{spec.name}_forward(int64_t B"):source.index(f"{spec.name}_adjoint(int64_t B")]
    assert "TS_COLUMN_AGAIN" not in forward and "TS_COLUMN_AGAIN" not in ts.source(spec, "c")
    _host_goal_step_against_the_definitions(spec, seed=7)
