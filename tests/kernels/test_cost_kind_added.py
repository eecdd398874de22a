"""A cost kind added as data: cuRobo's L1 bound, w·(max(0, y − (upper − m)) + max(0, (lower + m) − y)),
registered as one expression (codegen/costs.py ``KINDS``) and its parameters (spec.COST_KINDS), as
docs/costs.md shows. Nothing else is written for it: the C and CUDA kernels, the argument table,
the checks and the composite forms all follow from the entry.

Checked against the definition written here in NumPy (not the expression the kernels were made
from): values, and gradients against the plain step plus the definition in PyTorch.
"""
from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
import torch

import tensorstep as ts
from tensorstep.codegen import costs as kinds
from tensorstep.codegen import spec as spec_module
from tensorstep.runtime import costs as runtime_costs

L1 = kinds.CostKind("l1", kinds.W * (sp.Max(0, kinds.Y - (kinds.UPPER - kinds.MARGIN))
                                     + sp.Max(0, (kinds.LOWER + kinds.MARGIN) - kinds.Y)))
TERMS = (("l1", "velocity"), ("bound", "acceleration"), ("squared", "position"))


@pytest.fixture
def l1(monkeypatch, tmp_path):
    """The kind registered for one test, its kernels in a cache of their own (the generator's
    fingerprint does not cover a kind added by a test)."""
    monkeypatch.setenv("TENSORSTEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(kinds.KINDS, "l1", L1)
    monkeypatch.setitem(spec_module.COST_KINDS, "l1", L1.parameters)
    runtime_costs.sources.cache_clear()
    runtime_costs.pointwise.cache_clear()
    yield
    runtime_costs.sources.cache_clear()
    runtime_costs.pointwise.cache_clear()


def _data(spec, B=3):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    D = spec.dof
    x = dict(u=r(B, spec.n_actions, D), p0=r(B, D), v0=r(B, D), a0=r(B, D))
    params = {}
    for kind, state in spec.costs:
        params[f"{kind}_{state}_weight"] = r(B, D).abs() + 0.1
        params[f"{kind}_{state}_row_weight"] = r(spec.horizon).abs()
        if "limit" in spec_module.COST_KINDS[kind]:
            lo = -0.3 - r(D).abs()
            params[f"{kind}_{state}_limit"] = torch.stack([lo, lo + 0.5 + r(D).abs()])
            params[f"{kind}_{state}_margin"] = 0.05 * r(D).abs()
    params["squared_position_target"] = r(B, D)
    return x, params


def _definition(kind, y, w, rw, limit=None, margin=None, target=None):
    """One term from its definition (NumPy), y [B, H, D]: the sum over rows and dofs."""
    weight = w[:, None, :] * rw[None, :, None]
    if kind == "l1":
        lo, hi = limit[0] + margin, limit[1] - margin
        return (weight * (np.maximum(0, y - hi) + np.maximum(0, lo - y))).sum((1, 2))
    if kind == "bound":
        lo, hi = limit[0] + margin, limit[1] - margin
        return (weight * (np.maximum(0, y - hi) ** 2 + np.maximum(0, lo - y) ** 2)).sum((1, 2))
    return (weight * (y - (0 if target is None else target[:, None, :])) ** 2).sum((1, 2))


def _costs(spec, states, params, lib):
    """The terms from their definitions, ``lib`` NumPy (values) or PyTorch (gradients)."""
    out = []
    for kind, state in spec.costs:
        y = states[("position", "velocity", "acceleration", "jerk").index(state)]
        p = lambda name: params.get(f"{kind}_{state}_{name}")
        target = params["squared_position_target"] if (kind, state) == ("squared", "position") else None
        if lib is torch:
            weight = p("weight")[:, None, :] * p("row_weight")[None, :, None]
            if kind == "squared":
                out.append((weight * (y - target[:, None, :]) ** 2).sum((1, 2)))
                continue
            lo, hi = p("limit")[0] + p("margin"), p("limit")[1] - p("margin")
            over, under = torch.relu(y - hi), torch.relu(lo - y)
            out.append((weight * ((over + under) if kind == "l1" else (over ** 2 + under ** 2))).sum((1, 2)))
        else:
            out.append(_definition(kind, y, p("weight"), p("row_weight"), p("limit"), p("margin"), target))
    return lib.stack(out, 1) if lib is torch else np.stack(out, 1)


def test_the_kind_is_one_entry(l1):
    """The entry is all there is: a spec takes it, its argument table has the l1 term's limit and
    margin, and the expression's derivative is SymPy's (a step on each side, 0 inside)."""
    from tensorstep.codegen.arguments import table

    spec = ts.KernelSpec(horizon=9, dof=2, costs=TERMS, outputs=("P",))
    names = [a.name for a in table(spec).tensors]
    assert {"l1_velocity_weight", "l1_velocity_row_weight", "l1_velocity_limit", "l1_velocity_margin"} <= set(names)
    assert L1.parameters == ("limit", "margin") and L1.weighted and L1.nonnegative
    assert sp.simplify(L1.derivative - kinds.W * (sp.Heaviside(kinds.Y - kinds.UPPER + kinds.MARGIN, 0)
                                                  - sp.Heaviside(kinds.LOWER + kinds.MARGIN - kinds.Y, 0))) == 0


@pytest.mark.parametrize("target", ["c", "cuda"])
@pytest.mark.parametrize("control", ["position", "jerk"])
def test_an_added_kind_matches_its_definition(l1, control, target):
    """C, and the CUDA source run on the host (float64): P and the cost against the plain step's
    states plus the terms' definitions (NumPy, 1e-12); the gradients of u, p0 and the target
    against the plain step plus the definitions in PyTorch (1e-10)."""
    fields = dict(integrator="exact") if control == "jerk" else {}
    spec = ts.KernelSpec(horizon=9, dof=3, control=control, dtype="float64", costs=TERMS, outputs=("P",), **fields)
    if target == "cuda":
        from cuda_on_host import host_step

        step = host_step(spec)
    else:
        step = ts.load(spec)
    plain = ts.load(spec.replace(costs=(), outputs=None))
    x, params = _data(spec)
    runs = []
    for fused in (True, False):
        u, p0 = x["u"].clone().requires_grad_(), x["p0"].clone().requires_grad_()
        target_ = params["squared_position_target"].clone().requires_grad_()
        given = {**params, "squared_position_target": target_}
        if fused:
            P, cost = step(u, p0, x["v0"], x["a0"], 0.1, **given)
        else:
            states = plain(u, p0, x["v0"], x["a0"], 0.1)
            P, cost = states[0], _costs(spec, states, given, torch)
            with torch.no_grad():
                expected = _costs(spec, [s.numpy() for s in states], {k: v.detach().numpy() for k, v in given.items()},
                                  np)
        (P.square().sum() + (cost * torch.arange(1.0, 4.0, dtype=torch.float64)).sum()).backward()
        runs.append([P.detach(), cost.detach(), u.grad, p0.grad, target_.grad])
    np.testing.assert_allclose(runs[0][1].numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
    assert (runs[0][1][:, 0] > 0).all()  # the l1 term acts (the random walks cross the velocity limits)
    for got, want, name in zip(*runs, ("P", "cost", "u", "p0", "target")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * float(want.abs().max()), msg=name)


def test_an_added_kinds_parameters_are_checked(l1):
    """The call's checks name the added kind's keywords as a bound's."""
    spec = ts.KernelSpec(horizon=9, dof=3, dtype="float64", costs=TERMS, outputs=("P",))
    x, params = _data(spec)
    params["l1_velocity_limit"] = params["l1_velocity_limit"].flip(0)
    with pytest.raises(ValueError, match="l1_velocity_limit: lower > upper"):
        ts.load(spec)(x["u"], x["p0"], x["v0"], x["a0"], 0.1, **params)
    del params["l1_velocity_limit"]
    with pytest.raises(TypeError, match="this kernel needs a l1_velocity_limit argument"):
        ts.load(spec)(x["u"], x["p0"], x["v0"], x["a0"], 0.1, **params)


def test_an_added_kind_through_the_composite_forms(l1):
    """dt's gradient, forward mode and double backward run the kind's expression in PyTorch (the
    composite forms, runtime/costs.py): gradcheck with forward AD including a dt per trajectory, and
    gradgradcheck, float64."""
    from helpers import gradcheck64, gradgradcheck64

    spec = ts.KernelSpec(horizon=9, dof=2, control="jerk", integrator="exact", dt="per_trajectory",
                         dtype="float64", costs=TERMS, outputs=("P",))
    x, params = _data(spec, B=2)
    step = ts.load(spec)
    dt = torch.tensor([0.1, 0.07], dtype=torch.float64)
    u = x["u"].clone().requires_grad_()
    f = lambda uu, dd: step(uu, x["p0"], x["v0"], x["a0"], dd, **params)
    assert gradcheck64(f, [u, dt.clone().requires_grad_()], check_forward_ad=True)
    assert gradgradcheck64(lambda uu: f(uu, dt), [u])
