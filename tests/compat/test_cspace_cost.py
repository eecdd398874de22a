"""cuRobo v2's joint-space ("cspace") cost in tensorstep's terms (docs/costs.md): the mapping of its
weights, activation distance, non-terminal factor, retimed weights and MPPI discount onto the
cost terms' keyword tensors gives the same cost as cuRobo's formulas, written here in NumPy from
their description (per row h and dof d of a state y):

    bound:           ½·w·δ², δ the distance outside [lower + a·(upper − lower), upper − a·(upper − lower)]
    regularisation:  ½·w·y²                       (velocity, acceleration, jerk)
    target:          ½·w·f_h·(P − target)²        (f_h = f on non-terminal rows, 1 on the last)
    retimed weights: w·dt_b^k for the state's derivative order k (per trajectory b)
    discount:        every row's cost times γ^h   (MPPI)

The states come from the NumPy reference (tests/reference.py), not from the step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
import tensorstep as ts

STATES = ("position", "velocity", "acceleration", "jerk")
B, H, D = 4, 12, 3


def curobo_cspace_cost(Y: np.ndarray, dt: np.ndarray, p: dict) -> dict[str, np.ndarray]:
    """cuRobo's cost per trajectory, by term name, from the states Y [4, B, H, D] (P, V, A, J)."""
    rows = p["gamma"] ** np.arange(H)  # [H]
    out = {}
    for k, state in enumerate(STATES):
        y = Y[k]
        retime = dt[:, None, None] ** k if p["retime"] else np.ones((B, 1, 1))  # [B, 1, 1]
        lower, upper = p["limits"][state]
        span = upper - lower
        lo, hi = lower + p["activation_distance"] * span, upper - p["activation_distance"] * span
        delta = np.maximum(0.0, y - hi) + np.maximum(0.0, lo - y)
        out[f"bound_{state}"] = (0.5 * p["bound_weight"][state] * retime * delta**2 * rows[None, :, None]).sum(axis=(1, 2))
        if state != "position":
            out[f"squared_{state}"] = (0.5 * p["regularisation"][state] * retime * y**2
                                       * rows[None, :, None]).sum(axis=(1, 2))
    factor = np.where(np.arange(H) == H - 1, 1.0, p["non_terminal"])
    out["squared_position"] = (0.5 * p["target_weight"] * factor[None, :, None] * rows[None, :, None]
                               * (Y[0] - p["target"][:, None, :]) ** 2).sum(axis=(1, 2))
    return out


def tensorstep_keywords(dt: torch.Tensor, p: dict) -> dict[str, torch.Tensor]:
    """docs/costs.md's table: cuRobo's parameters as the cost terms' keyword tensors."""
    f64 = torch.float64
    gamma = p["gamma"] ** torch.arange(H, dtype=f64)
    kw = {}
    for k, state in enumerate(STATES):
        retime = dt[:, None] ** k if p["retime"] else torch.ones(B, 1, dtype=f64)  # a [B, D] weight
        lower, upper = (torch.tensor(x, dtype=f64) for x in p["limits"][state])
        kw[f"bound_{state}_weight"] = 0.5 * torch.tensor(p["bound_weight"][state], dtype=f64) * retime
        kw[f"bound_{state}_limit"] = torch.stack([lower, upper])
        kw[f"bound_{state}_margin"] = p["activation_distance"] * (upper - lower)
        kw[f"bound_{state}_row_weight"] = gamma
        if state != "position":
            kw[f"squared_{state}_weight"] = 0.5 * torch.tensor(p["regularisation"][state], dtype=f64) * retime
            kw[f"squared_{state}_row_weight"] = gamma
    factor = torch.full((H,), p["non_terminal"], dtype=f64)
    factor[-1] = 1.0
    kw["squared_position_weight"] = torch.full((D,), 0.5 * p["target_weight"], dtype=f64)
    kw["squared_position_row_weight"] = factor * gamma
    kw["squared_position_target"] = torch.tensor(p["target"], dtype=f64)
    return kw


@pytest.mark.parametrize("retime, gamma", [(False, 1.0), (True, 1.0), (True, 0.9)])
def test_curobo_cspace_cost_in_tensorstep_terms(retime, gamma):
    rng = np.random.default_rng(3)
    terms = tuple(("bound", s) for s in STATES) + tuple(("squared", s) for s in STATES)
    spec = ts.KernelSpec(horizon=H, dof=D, dtype="float64", dt="per_trajectory", costs=terms, outputs=("P",))
    u, start = rng.normal(size=(B, H - 1, D)), rng.normal(size=(B, 4, D))
    dt = rng.uniform(0.05, 0.15, B)
    Y = np.array([[reference.column(spec.replace(costs=(), outputs=None), u[b, :, d], start[b, :, d], dt[b])
                   for d in range(D)] for b in range(B)]).transpose(2, 0, 3, 1)  # [4, B, H, D]
    limits = {}
    for k, state in enumerate(STATES):  # limits that some rows cross on either side
        q = np.quantile(Y[k].reshape(-1, D), [0.25, 0.75], axis=0)
        limits[state] = (q[0], q[1])
    p = dict(limits=limits, activation_distance=0.1, retime=retime, gamma=gamma, non_terminal=0.3,
             bound_weight={s: rng.uniform(0.5, 2.0, D) for s in STATES},
             regularisation={s: rng.uniform(0.5, 2.0, D) for s in STATES},
             target_weight=3.0, target=rng.normal(size=(B, D)))
    expected = curobo_cspace_cost(Y, dt, p)
    assert all(expected[f"bound_{s}"].min() > 0 for s in STATES)  # every bound term active somewhere

    step = ts.load(spec)
    t = lambda x: torch.tensor(x, dtype=torch.float64)
    dt_t = t(dt)
    P, cost = step(t(u), *(t(start[:, i]) for i in range(3)), dt_t, j0=t(start[:, 3]), **tensorstep_keywords(dt_t, p))
    for column, (kind, state) in enumerate(terms):
        np.testing.assert_allclose(cost[:, column].numpy(), expected[f"{kind}_{state}"], rtol=1e-10, atol=1e-12,
                                   err_msg=f"{kind}_{state}")
