"""cuRobo v2's position and B-spline kernels as operators of the generic IR.

Data for the same generator as every other spec: the points each row reads given as formulas
in the start state, the actions and the goal state (ghost rows and the held value of the
position kernel; the boundary control points of the B-spline, from codegen/bspline.py's
symbolic basis), then fixed weights in the step duration. Lowering and templates are shared.
"""
from __future__ import annotations

from fractions import Fraction

import sympy as sp

from . import bspline
from .arguments import table
from .builders import register
from .curobo_v2_spec import CuroboV2Spec
from .operator import Operator, Row, RowTerm, action, combine, dt_symbols, goal, reads, scaled, start
from .schemes import stencil_row

R = sp.Rational
ONE = sp.Integer(1)

#: five-point central weights over X[h−2..h+2] for V, A, J (times 1/dt^k)
CENTRAL = {
    1: [R(1, 12), -R(2, 3), 0, R(2, 3), -R(1, 12)],
    2: [-R(1, 12), R(4, 3), -R(5, 2), R(4, 3), -R(1, 12)],
    3: [-R(1, 2), 1, 0, -1, R(1, 2)],
}


def clique(spec: CuroboV2Spec) -> Operator:
    """Rows read the extended positions X[r], r = −2 … H+1 (dt the trajectory's step):
    X[−2..0] the start's ghosts (a parabola with v0, a0 at row −1 through p0 at row 1),
    X[1] = p0, X[r] = u[r−2] up to r = H−4, X[r] = L (the goal entry gp) from H−3 on.
    P[h] = X[h]; V, A, J are five-point central differences over X[h−2..h+2]."""
    (dt,) = syms = dt_symbols(spec.horizon, spec.dt)
    H = spec.horizon
    ghosts = {
        -2: [(ONE, start(0)), (-3 * dt, start(1)), (-R(3, 2) * dt**2, start(2))],
        -1: [(ONE, start(0)), (-2 * dt, start(1)), (-2 * dt**2, start(2))],
        0: [(ONE, start(0)), (-dt, start(1)), (-R(3, 2) * dt**2, start(2))],
        1: [(ONE, start(0))],
    }

    def X(r: int) -> list[RowTerm]:
        if r <= 1:
            return list(ghosts[r])
        return [(ONE, action(r - 2))] if r <= H - 4 else [(ONE, goal(0))]

    rows = []
    for h in range(H):
        window = [X(h - 2 + i) for i in range(5)]
        rows.append(Row(0, h, combine(window[2])))
        for k, w in CENTRAL.items():
            rows.append(stencil_row(k, h, [c / dt**k for c in w], window))
    return Operator(H, spec.order, spec.n_actions, syms, rows, inputs=reads(table(spec)))


def _boundary(degree: int, side: str, kdt: sp.Expr) -> list[list[RowTerm]]:
    """The D+1 boundary points of a state (its entries ``start(m)`` or ``goal(m)``): the span whose
    polynomial is the state's Taylor polynomial about the span's start; degree 3 drops the jerk term."""
    coeffs = bspline.boundary_points(degree, "start").coeffs
    entry = start if side == "start" else goal
    used = 3 if degree == 3 else 4
    return [[(c * kdt**m, entry(m)) for m, c in enumerate(row[:used]) if c != 0] for row in coeffs]


def bspline_rows(spec: CuroboV2Spec) -> Operator:
    """Control points [F(start), u_0..u_{n−2}, G(goal)] (u_{n−1} is not read: the compat layer
    passes it as the goal when the flag is off); row h uses span j = ⌊h/s⌋ at t = (h mod s)/s,
    rows from T·s on the last span at t = 1; outputs Σ_i B_i^(k)(t) q_{j+i} / kdt^k, kdt = s·dt."""
    (dt,) = syms = dt_symbols(spec.horizon, spec.dt)
    D, s, T = spec.degree, spec.steps, spec.spans
    kdt = s * dt
    points = (_boundary(D, "start", kdt) + [[(ONE, action(k))] for k in range(spec.knots - 1)]
              + _boundary(D, "goal", kdt))
    assert len(points) == T + D
    basis = [bspline.derivative_matrix(D, k) for k in range(spec.order + 1)]
    rows = []
    for h in range(spec.horizon):
        j, t = h // s, Fraction(h % s, s)
        if j >= T:
            j, t = T - 1, Fraction(1)
        tt = R(t.numerator, t.denominator)
        for k, M in enumerate(basis):
            terms: list[RowTerm] = []
            for i in range(D + 1):
                weight = sum((M[i, c] * tt**c for c in range(D + 1)), sp.Integer(0))
                if weight != 0:
                    terms += scaled(points[j + i], weight / kdt**k)
            rows.append(Row(k, h, combine(terms)))
    return Operator(spec.horizon, spec.order, spec.n_actions, syms, rows, inputs=reads(table(spec)))


BUILDERS = {"clique": clique, "bspline": bspline_rows}


@register(CuroboV2Spec)
def build_curobo_v2_operator(spec: CuroboV2Spec) -> Operator:
    return BUILDERS[spec.kind](spec)
