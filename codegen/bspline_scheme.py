"""B-spline control (control="bspline") as an operator of the generic IR.

Row h lies in span j at local parameter t (codegen/bspline.py's layout); its control points are
knots u_k, the start's boundary points F_i (affine in the start state, coefficients in
kdt = steps·dt) and, with end="goal", the goal's G_i. So every output is a direct combination
of the inputs (no row reads another row):

    Y[k][h] = Σ_i (Σ_c M^(k)[i, c] t^c) / kdt^k · q_{j+i}.

The coefficients are exact rationals times powers of the one dt symbol; terms on the same
input are merged exactly, so row 0 reduces to the start state itself and, with end="goal",
the last row to the goal state.
"""
from __future__ import annotations

from fractions import Fraction

import sympy as sp

from .bspline import Layout, boundary_points, derivative_matrix, layout
from .builders import register
from .arguments import table
from .operator import Operator, Row, action, dt_symbols, goal, reads, start
from .spec import KernelSpec


Point = list  # a control point: [(Fraction, ref, power of kdt)]


def point_terms(source: str, index: int, sides: dict) -> Point:
    """A control point: a knot, or F_i / G_i = Σ_m C[i, m] · kdt^m · state_m."""
    if source == "knot":
        return [(Fraction(1), action(index), 0)]
    entry, coeffs = (start if source == "start" else goal), sides[source][index]
    return [(Fraction(int(c.p), int(c.q)), entry(m), m) for m, c in enumerate(coeffs) if c != 0]


def _weights(degree: int, order: int, t: Fraction) -> list[list[Fraction]]:
    """w[k][i] = d^k B_i/dt^k at t, exact (the polynomial's coefficients from bspline.py)."""
    out = []
    for k in range(order + 1):
        Mk = derivative_matrix(degree, k)
        out.append([sum((Fraction(int(Mk[i, c].p), int(Mk[i, c].q)) * t**c for c in range(degree + 1)), Fraction(0))
                    for i in range(degree + 1)])
    return out


def bspline_rows(lay: Layout, order: int, dt: sp.Symbol) -> list[Row]:
    """Rows Y[k][h], k = 0..order, h = 0..R−1, in row order (each row depends on inputs only).

    Weights are summed per input in exact fractions; each coefficient is then one rational times
    a power of dt (kdt^(m−k) for state entry m, kdt^(−k) for a knot), so equal inputs merge
    exactly and cancelled terms vanish.
    """
    D, s = lay.degree, lay.steps
    sides = {side: boundary_points(D, side).coeffs for side in ("start", "goal")}
    points = [point_terms(source, index, sides) for source, index in lay.points]
    weights = {t: _weights(D, order, t) for t in {t for _, t in lay.rows}}
    rows: list[Row] = []
    for h, (j, t) in enumerate(lay.rows):
        for k in range(order + 1):
            acc: dict[tuple, list] = {}
            for i, w in enumerate(weights[t][k]):
                for c, ref, m in points[j + i]:
                    slot = acc.setdefault(ref, [Fraction(0), m - k])
                    slot[0] += w * c
            terms = tuple((sp.Rational(v.numerator, v.denominator) * (s * dt) ** p, ref)
                          for ref, (v, p) in acc.items() if v != 0)
            rows.append(Row(k, h, terms))
    return rows


@register(KernelSpec, control="bspline")
def build(spec: KernelSpec) -> Operator:
    """The operator of a B-spline spec (docs/semantics.md, B-spline control): R = T·s + 1 rows over n knots."""
    syms = dt_symbols(spec.horizon, spec.dt)  # one symbol: uniform, or one per trajectory
    lay = layout(spec.degree, spec.knots, spec.steps, spec.end)
    assert lay.horizon == spec.horizon, (lay.horizon, spec.horizon)
    rows = bspline_rows(lay, spec.order, syms[0])
    return Operator(spec.horizon, spec.order, spec.knots, syms, rows, inputs=reads(table(spec)))
