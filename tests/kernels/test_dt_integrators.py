"""An integrator's dt gradient (the dt_vjp kernel) at a horizon where its reverse sweep is rolled
into a loop over the rows, reading the forward's values from the launcher's forward run: against
finite differences of the independent float64 reference (tests/reference.py), for the C kernels
and the CUDA source run on the host; and its source does not grow with the horizon."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen.driver import generate

import reference
from cuda_on_host import host_step
from helpers import Inputs, grid_id, to_bhd

H_ROLLED = 40  # long enough that the interior rows are one loop

#: acceleration and jerk, exact and semi-implicit, every dt mode (with a few other options mixed in)
CASES = [
    dict(control="acceleration", dt="uniform"),
    dict(control="acceleration", dt="per_trajectory", start_index=True),
    dict(control="acceleration", dt="per_step", layout="bdh"),
    dict(control="acceleration", integrator="exact", dt="uniform", start_index=True),
    dict(control="acceleration", integrator="exact", dt="per_trajectory"),
    dict(control="acceleration", integrator="exact", dt="per_step", order=4),
    dict(control="jerk", dt="uniform", order=4),
    dict(control="jerk", dt="per_trajectory", layout="bdh"),
    dict(control="jerk", dt="per_step"),
    dict(control="jerk", integrator="exact", dt="uniform"),
    dict(control="jerk", integrator="exact", dt="per_trajectory", order=4, start_index=True),
    dict(control="jerk", integrator="exact", dt="per_step", order=4),
]
B = 3


def _spec(overrides: dict, horizon: int = H_ROLLED, dtype: str = "float64") -> ts.KernelSpec:
    return ts.KernelSpec(horizon=horizon, dof=2, dtype=dtype, **overrides)


def _dt(spec) -> np.ndarray:
    """Step durations: one (uniform), one per trajectory, or one per step, in [0.05, 0.15)."""
    size = {"uniform": (), "per_trajectory": (B,), "per_step": (spec.horizon,)}[spec.dt]
    return 0.05 + 0.1 * np.random.default_rng(3).random(size)


def _reference(spec, dt: np.ndarray, x: Inputs) -> np.ndarray:
    """Outputs [K, B, H, D] of the reference; per trajectory, each with its own dt."""
    u, s = x.numpy_u_bhd(), x.numpy_start()
    if spec.dt == "per_trajectory":
        return np.concatenate([reference.apply(spec, [dt[b]], u[b:b + 1], s[b:b + 1]) for b in range(B)], axis=1)
    return np.asarray(reference.apply(spec, np.atleast_1d(dt).tolist(), u, s))


def _directional(spec, dt: np.ndarray, x: Inputs, direction: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d/dε reference(dt + ε·direction) at ε = 0, by a fourth-order central difference."""
    f = lambda e: _reference(spec, dt + e * direction, x)
    return (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)


@pytest.mark.parametrize("path", ["c", "cuda-on-host"])
@pytest.mark.parametrize("overrides", CASES, ids=grid_id)
def test_dt_gradient_matches_finite_differences(overrides, path):
    """The dt gradient of Σ g·Y (g random, one output without a gradient), projected on random
    directions, against finite differences of the reference along them."""
    spec = _spec(overrides)
    x = Inputs(spec, batch=B)
    step = ts.load(spec, "cpu") if path == "c" else host_step(spec)
    dt_np = _dt(spec)
    dt = torch.tensor(dt_np, dtype=torch.float64, requires_grad=True)
    outs = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs]
    gs[1] = torch.zeros_like(gs[1])  # V unused: its gradient is absent
    loss = sum((g * y).sum() for k, (g, y) in enumerate(zip(gs, outs)) if k != 1)
    (got,) = torch.autograd.grad(loss, [dt])
    g = np.stack([to_bhd(gk, spec) for gk in gs])
    for direction in np.random.default_rng(7).normal(size=(3, *dt_np.shape)):
        expected = float((g * _directional(spec, dt_np, x, direction)).sum())
        actual = float((got.numpy() * direction).sum())
        assert abs(actual - expected) <= 1e-7 * max(1.0, abs(expected)), (actual, expected)


def _dt_vjp_sizes(overrides: dict, horizon: int) -> tuple[int, int]:
    """Characters of the dt_vjp kernels' C and CUDA sources (with dt_vjp_finish and the table)."""
    g = generate(_spec(overrides, horizon, "float32"), targets=("c", "cuda"), parts=("dt_vjp",))
    return len(g.source("c", "dt_vjp")), len(g.source("cuda", "dt_vjp"))


@pytest.mark.parametrize("overrides", [dict(control="acceleration", integrator="exact", start_index=True),
                                       dict(control="jerk", integrator="exact", dt="per_step", order=4)], ids=grid_id)
def test_dt_vjp_source_grows_by_a_small_constant_per_row(overrides):
    """The reverse sweep is one loop whatever the horizon (it was one line per row and coefficient
    use, 222 KB of C at H=256): the source grows by a few bytes per row (longer numbers, and with
    per-step dt one zeroing line of dt_vjp_finish per duration)."""
    sizes = {h: _dt_vjp_sizes(overrides, h) for h in (64, 256)}
    per_row = 30 if overrides.get("dt") == "per_step" else 2
    for target in (0, 1):
        assert sizes[256][target] - sizes[64][target] <= per_row * (256 - 64), sizes
        assert sizes[256][target] < 40_000, sizes


@pytest.mark.parametrize("path", ["c", "cuda-on-host"])
@pytest.mark.parametrize("overrides", [dict(control="acceleration", integrator="exact", dt="uniform"),
                                       dict(control="jerk", dt="per_trajectory", order=4)], ids=grid_id)
def test_long_uniform_dt_jvp_is_rolled_and_matches_finite_differences(overrides, path):
    """Past lower.ROLL_DT_JVP_ROWS rows an integrator's dt_jvp is rolled with uniform dt too: the
    outputs' tangent along a random dt direction against finite differences of the reference."""
    import torch.autograd.forward_ad as fwAD

    spec = _spec(overrides, horizon=80)
    assert "; ++r)" in generate(spec, targets=("c",), parts=("dt_jvp",)).source("c", "dt_jvp")
    x = Inputs(spec, batch=B)
    step = ts.load(spec, "cpu") if path == "c" else host_step(spec)
    dt_np = _dt(spec)
    direction = np.random.default_rng(6).normal(size=dt_np.shape)
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.tensor(dt_np), torch.tensor(direction))
        outs = step(x.u, x.p0, x.v0, x.a0, dual, **x.kwargs())
        tangents = [fwAD.unpack_dual(y).tangent for y in outs]
    expected = _directional(spec, dt_np, x, direction)
    for k, t in enumerate(tangents):
        scale = max(1.0, float(np.abs(expected[k]).max()))
        assert float(np.abs(to_bhd(t, spec) - expected[k]).max()) <= 1e-7 * scale, k
