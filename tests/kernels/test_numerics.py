"""Kernels and operator matrices against the independent float64 reference (docs/semantics.md, docs/numerics.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorstep as ts

import reference
from helpers import (GRID, Inputs, dt_value, gradcheck64, gradgradcheck64, grid_id, make_spec, scale_close,
                     to_bhd)
from sweep import FULL


def test_operator_matrices_match_reference(spec):
    dt = dt_value(spec).tolist()
    got = ts.operator_matrices(spec, dt)
    M_u, M_s = reference.matrices(spec, dt)
    scale_close(got["u"], M_u, 1e-12)
    scale_close(got["start"], M_s, 1e-12)


def test_c_kernel_matches_reference(spec):
    step = ts.load(spec, "cpu")
    x = Inputs(spec)
    dt = dt_value(spec)
    outs = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    assert len(outs) == spec.order + 1
    expected = reference.apply(spec, dt.tolist(), x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(outs):
        scale_close(to_bhd(y, spec), expected[k], 1e-12)


def test_adjoint_dot_product(spec, autograd_path):
    """<A x, g> = <x, Aᵀ g> to 1e-12 with the generated forward and adjoint kernels."""
    step = autograd_path(ts.load(spec, "cpu"))
    x = Inputs(spec, requires_grad=True)
    dt = dt_value(spec)
    outs = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    gen = torch.Generator().manual_seed(1)
    gs = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs]
    inputs = [x.u, x.p0, x.v0, x.a0, x.j0]
    grads = torch.autograd.grad(outs, inputs, gs)
    lhs = sum(float((y.detach() * g).sum()) for y, g in zip(outs, gs))
    rhs = sum(float((t.detach() * g).sum()) for t, g in zip(inputs, grads))
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)


def test_gradcheck_with_forward_ad(spec):
    step = ts.load(spec, "cpu")
    x = Inputs(spec, batch=2, requires_grad=True)
    dt = dt_value(spec, requires_grad=True)
    kw = {"start_index": x.idx} if x.idx is not None else {}
    f = lambda u, p0, v0, a0, j0, dt: step(u, p0, v0, a0, dt, j0=j0, **kw)
    assert gradcheck64(f, (x.u, x.p0, x.v0, x.a0, x.j0, dt), check_forward_ad=True)


#: each grid row through one autograd path, the two taking turns (both under TENSORSTEP_FULL_SWEEP=1): either
#: path's double backward is the same generic code at every row, and each path still meets stencils and
#: integrators of every dt mode (the first derivatives run every row on both paths above)
GRADGRAD = [(g, path) for i, g in enumerate(GRID) for path in ("native", "python")
            if FULL or path == ("native", "python")[i % 2]]


@pytest.mark.parametrize("spec, autograd_path", GRADGRAD, indirect=True,
                         ids=[f"{grid_id(g)}-{path}" for g, path in GRADGRAD])
def test_gradgradcheck(spec, autograd_path):
    step = autograd_path(ts.load(spec, "cpu"))
    x = Inputs(spec, batch=2, requires_grad=True)
    dt = dt_value(spec)
    kw = {"start_index": x.idx} if x.idx is not None else {}
    f = lambda u, p0, v0, a0, j0: step(u, p0, v0, a0, dt, j0=j0, **kw)
    assert gradgradcheck64(f, (x.u, x.p0, x.v0, x.a0, x.j0), check_fwd_over_rev=True)


FLOAT32_GRID = [g for g in GRID if not g.get("order") == 4][::2]


@pytest.mark.parametrize("overrides", FLOAT32_GRID, ids=[grid_id(g) for g in FLOAT32_GRID])
def test_float32_matches_float64(overrides):
    spec32 = make_spec(overrides, dtype="float32")
    spec64 = make_spec(overrides, dtype="float64")
    x64 = Inputs(spec64)
    x32 = Inputs(spec32)
    dt64 = dt_value(spec64)
    out32 = ts.load(spec32)(x32.u, x32.p0, x32.v0, x32.a0, dt_value(spec32), **x32.kwargs())
    out64 = ts.load(spec64)(x64.u, x64.p0, x64.v0, x64.a0, dt64, **x64.kwargs())
    for a, b in zip(out32, out64):
        scale_close(a.double().numpy(), b.numpy(), 2e-5)


EXACT = [g for g in GRID if g.get("control", "position") == "position" and g.get("end") == "one_sided"]


@pytest.mark.parametrize("overrides", EXACT, ids=[grid_id(g) for g in EXACT])
def test_polynomial_exactness(overrides):
    """docs/semantics.md (Exactness): degree ≤ min(3, k + a_k - 1) (uniform) or ≤ min(3, n_k - 1) (per step) is exact."""
    spec = make_spec(overrides, horizon=10, dof=1)
    step = ts.load(spec)
    dt = dt_value(spec)
    dts = reference.step_durations(spec, dt.tolist())
    t = np.concatenate([[0.0], np.cumsum(dts[1:])])
    rng = np.random.default_rng(3)
    for k in range(1, spec.order + 1):
        a = spec.accuracy[k - 1]
        if spec.dt == "uniform":
            degree = min(3, k + a - 1)
        else:
            n_central = 2 * ((k + 1) // 2) - 1 + a if spec.difference == "central" else k + a
            degree = min(3, min(n_central, k + a) - 1)
        c = rng.normal(size=degree + 1)
        poly = np.polynomial.Polynomial(c)
        derivs = [poly.deriv(m) if m else poly for m in range(5)]
        start = [float(derivs[m](0.0)) for m in range(4)]
        u = torch.tensor(poly(t[1:]), dtype=torch.float64).reshape(1, -1, 1)
        s = [torch.tensor([[v]], dtype=torch.float64) for v in start]
        outs = step(u, s[0], s[1], s[2], dt, j0=s[3])
        got = outs[k].numpy().ravel()
        scale_close(got, derivs[k](t), 1e-9)
