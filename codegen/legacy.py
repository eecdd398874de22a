"""cuRobo's legacy kernels (docs/compat_curobo.md) as operators of the generic IR.

Each is data for the same generator as native specs: points given as formulas in the
start state (ghosts), fixed stencil weights in the step parameter, cuRobo's row mapping and
held tail, and its integrators. Only the operator differs; lowering and templates are shared.
"""
from __future__ import annotations

from typing import Callable

import sympy as sp

from .builders import register
from .legacy_spec import LegacySpec
from .operator import Operator, Row, RowTerm, action, combine, row_ref, scaled, start
from .schemes import stencil_row

R = sp.Rational
P, V, A = start(0), start(1), start(2)


def _legacy_start_rows() -> list[Row]:
    """Row 0 is (p, v, a, 0): the legacy kernels take no start jerk."""
    return [Row(0, 0, ((sp.Integer(1), P),)), Row(1, 0, ((sp.Integer(1), V),)),
            Row(2, 0, ((sp.Integer(1), A),)), Row(3, 0, ())]


def clique_backward(spec: LegacySpec) -> Operator:
    """Backward differences with D = traj_dt[0] = 1/τ; ghosts x_{-m} = p - m(v - ½aD)·D."""
    D = sp.Symbol("inv_dt", positive=True)

    def x(k: int) -> list[RowTerm]:
        if k >= 1:
            return [(sp.Integer(1), action(k - 1))]
        if k == 0:
            return [(sp.Integer(1), P)]
        m = -k
        return [(sp.Integer(1), P), (-m * D, V), (m * D * D / 2, A)]

    weights = {1: [1, -1], 2: [1, -2, 1], 3: [1, -3, 3, -1]}
    rows = _legacy_start_rows()
    for h in range(1, spec.horizon):
        rows.append(Row(0, h, tuple(x(h))))
        for k, w in weights.items():
            rows.append(stencil_row(k, h, [c * D**k for c in w], [x(h - i) for i in range(len(w))]))
    return Operator(spec.horizon, 3, spec.n_actions, (D,), rows)


def clique_central(spec: LegacySpec) -> Operator:
    """Five-point central windows over y_{h-2..h+2}; P_h = y_h (y_1 = p); the last action is held."""
    D = sp.Symbol("inv_dt", positive=True)
    tau = 1 / D
    n_act = spec.n_actions
    ghosts = {
        -2: [(sp.Integer(1), P), (-3 * tau, V), (-R(3, 2) * tau**2, A)],
        -1: [(sp.Integer(1), P), (-2 * tau, V), (-2 * tau**2, A)],
        0: [(sp.Integer(1), P), (-tau, V), (-R(3, 2) * tau**2, A)],
        1: [(sp.Integer(1), P)],
    }

    def y(k: int) -> list[RowTerm]:
        return list(ghosts[k]) if k <= 1 else [(sp.Integer(1), action(min(k - 2, n_act - 1)))]

    stencils = {
        1: [R(1, 12), -R(2, 3), 0, R(2, 3), -R(1, 12)],
        2: [-R(1, 12), R(4, 3), -R(5, 2), R(4, 3), -R(1, 12)],
        3: [-R(1, 2), 1, 0, -1, R(1, 2)],
    }
    rows = []
    for h in range(spec.horizon):
        window = [y(h - 2 + i) for i in range(5)]
        rows.append(Row(0, h, combine(window[2])))
        for k, w in stencils.items():
            rows.append(stencil_row(k, h, [c * D**k for c in w], window))
    return Operator(spec.horizon, 3, n_act, (D,), rows)


def _acceleration(spec: LegacySpec, lower_rows: Callable) -> Operator:
    taus = tuple(sp.Symbol(f"dt_{h}", positive=True) for h in range(spec.horizon))
    rows = _legacy_start_rows()
    for h in range(1, spec.horizon):
        tau = taus[h]
        rows.append(Row(2, h, ((sp.Integer(1), action(h - 1)),)))
        rows += lower_rows(h, tau)
        rows.append(Row(3, h, combine(scaled(row_ref(2, h), 1 / tau) + scaled(row_ref(2, h - 1), -1 / tau))))
    return Operator(spec.horizon, 3, spec.n_actions, taus, rows)


def accel_semi_euler(spec: LegacySpec) -> Operator:
    """V_h = V_{h-1} + τ_h A_h, P_h = P_{h-1} + τ_h V_h (the Idx class)."""
    def lower_rows(h: int, tau: sp.Expr) -> list[Row]:
        return [Row(1, h, combine(row_ref(1, h - 1) + scaled(row_ref(2, h), tau))),
                Row(0, h, combine(row_ref(0, h - 1) + scaled(row_ref(1, h), tau)))]

    return _acceleration(spec, lower_rows)


def accel_rk2(spec: LegacySpec) -> Operator:
    """cuRobo's 'rk2': P_h = P_{h-1} + τV_{h-1} + ½τ²A_h, V_h = V_{h-1} + ½τA_h (kept as is)."""
    def lower_rows(h: int, tau: sp.Expr) -> list[Row]:
        return [Row(0, h, combine(row_ref(0, h - 1) + scaled(row_ref(1, h - 1), tau) + scaled(row_ref(2, h), tau**2 / 2))),
                Row(1, h, combine(row_ref(1, h - 1) + scaled(row_ref(2, h), tau / 2)))]

    return _acceleration(spec, lower_rows)


BUILDERS = {"clique_backward": clique_backward, "clique_central": clique_central,
            "accel_semi_euler": accel_semi_euler, "accel_rk2": accel_rk2}


@register(LegacySpec)
def build_legacy_operator(spec: LegacySpec) -> Operator:
    return BUILDERS[spec.kind](spec)
