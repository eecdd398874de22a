"""Uniform B-spline trajectories: basis, derivatives, boundary points, row layout (their
semantics: docs/semantics.md, "B-spline control").

Everything is derived with SymPy in exact rationals for any degree D (3 ≤ D ≤ 7):

- one span's basis B_i(t) = N_D(t + D − i), t ∈ [0, 1], i = 0..D, from the cardinal
  B-spline's truncated-power form N_D(x) = 1/D! Σ_j (−1)^j C(D+1, j) (x − j)_+^D;
- the boundary points F (start) and G (goal) by solving "span polynomial = Taylor polynomial";
- which control point and which (span, t) every output row uses (pure Python, Fractions).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, Sequence

import sympy as sp

from .spec import BSPLINE_DEGREES

MIN_DEGREE, MAX_DEGREE = BSPLINE_DEGREES  # the spec's range, one definition
STATE_NAMES = ("p", "v", "a", "j")
Side = Literal["start", "goal"]
End = Literal["hold", "goal"]


def check_degree(degree: int) -> int:
    """The degree, or a ValueError naming the allowed range."""
    if isinstance(degree, bool) or not isinstance(degree, int) or not MIN_DEGREE <= degree <= MAX_DEGREE:
        raise ValueError(f"degree={degree!r} is invalid: allowed integers {MIN_DEGREE}..{MAX_DEGREE}")
    return degree


@functools.lru_cache(maxsize=None)
def basis_matrix(degree: int) -> sp.ImmutableMatrix:
    """M, (D+1)×(D+1), with B_i(t) = Σ_k M[i, k] t^k on one span (q_0 oldest .. q_D newest).

    On t ∈ [0, 1], x = t + D − i lies in [D − i, D − i + 1], where (x − j)_+ = x − j for
    j ≤ D − i and 0 otherwise, so B_i(t) = 1/D! Σ_{j=0..D−i} (−1)^j C(D+1, j) (t + D − i − j)^D;
    the binomial theorem gives M[i, k] = C(D, k)/D! Σ_{j=0..D−i} (−1)^j C(D+1, j) (D − i − j)^(D−k).
    """
    D = check_degree(degree)
    return sp.ImmutableMatrix(D + 1, D + 1, lambda i, k: sp.Rational(
        math.comb(D, k) * sum((-1) ** j * math.comb(D + 1, j) * (D - i - j) ** (D - k) for j in range(D - i + 1)),
        math.factorial(D),
    ))


@functools.lru_cache(maxsize=None)
def derivative_matrix(degree: int, order: int) -> sp.ImmutableMatrix:
    """M^(k) with d^k B_i/dt^k = Σ_c M^(k)[i, c] t^c: M^(k)[i, c] = M[i, c+k] (c+k)!/c! (zero for c > D−k).

    order 0 is `basis_matrix`; order > D gives the zero matrix. Divide by kdt^k for time derivatives.
    """
    if order < 0:
        raise ValueError(f"order={order!r} is invalid: allowed integers ≥ 0")
    M = basis_matrix(degree)
    n = M.shape[0]
    return sp.ImmutableMatrix(
        n, n, lambda i, c: M[i, c + order] * sp.ff(c + order, order) if c + order < n else 0
    )


@dataclass(frozen=True)
class BoundaryPoints:
    """Boundary control points of one side: F_i = Σ_m coeffs[i][m] · state_m · kdt^m.

    i = 0..D (the span's control points, oldest first), m = 0..3 (p, v, a, j).
    """

    degree: int
    side: str
    coeffs: tuple[tuple[sp.Rational, ...], ...]

    def as_floats(self) -> list[list[float]]:
        """The coefficients as floats, for printing."""
        return as_floats(self.coeffs)


@functools.lru_cache(maxsize=None)
def boundary_points(degree: int, side: Side) -> BoundaryPoints:
    """The unique D+1 points whose span polynomial is the state's Taylor polynomial.

    Σ_i B_i(t) F_i = Σ_m state_m (kdt·(t − t0))^m / m!, with t0 = 0 ("start": τ = time since the
    span's start) or t0 = 1 ("goal": τ = time relative to the span's end). Matching the
    coefficients of t^0..t^D gives Mᵀ C = Y with Y[k, m] = C(m, k) (−t0)^(m−k) / m! (zero for
    k > m); Mᵀ is invertible (the D+1 basis polynomials span degree ≤ D), so C is unique, and
    D ≥ 3 lets the whole cubic (jerk included) be matched.
    """
    D = check_degree(degree)
    if side not in ("start", "goal"):
        raise ValueError(f"side={side!r} is invalid: allowed 'start', 'goal'")
    t0 = 0 if side == "start" else 1
    rhs = sp.Matrix(
        D + 1, 4,
        lambda k, m: sp.binomial(m, k) * sp.Integer(-t0) ** (m - k) / sp.factorial(m) if k <= m else 0,
    )
    C = basis_matrix(D).T.LUsolve(rhs)
    return BoundaryPoints(D, side, tuple(tuple(sp.Rational(C[i, m]) for m in range(4)) for i in range(D + 1)))


def as_floats(rows: sp.MatrixBase | Sequence[Sequence[sp.Expr]]) -> list[list[float]]:
    """A rational matrix (SymPy Matrix or nested sequences) as nested lists of floats."""
    if isinstance(rows, sp.MatrixBase):
        rows = rows.tolist()
    return [[float(x) for x in row] for row in rows]


@dataclass(frozen=True)
class Layout:
    """Where a B-spline trajectory's control points come from and where each output row lies.

    points[c] = (source, index): ("start", i) is F_i, ("knot", k) is u_k, ("goal", i) is G_i.
    rows[h] = (span j, local t ∈ [0, 1]); span j uses points[j .. j + D].
    """

    degree: int
    knots: int
    steps: int
    end: str
    points: tuple[tuple[str, int], ...]
    rows: tuple[tuple[int, Fraction], ...]

    @property
    def spans(self) -> int:
        """T = m − D for m control points."""
        return len(self.points) - self.degree

    @property
    def horizon(self) -> int:
        """R = T·s + 1 output rows."""
        return len(self.rows)


def layout(degree: int, knots: int, steps: int, end: End) -> Layout:
    """docs/semantics.md's B-spline control sequence and row → (span, t) map.

    points: F_0..F_D, u_0..u_{n−1}, then G_0..G_D ("goal") or u_{n−1} D more times ("hold").
    T = m − D spans, R = T·s + 1 rows; row h: j = min(h // s, T − 1), t = h/s − j.
    """
    D = check_degree(degree)
    for name, value in (("knots", knots), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: allowed integers ≥ 1")
    if end == "goal":
        tail = [("goal", i) for i in range(D + 1)]
    elif end == "hold":
        tail = [("knot", knots - 1)] * D
    else:
        raise ValueError(f"end={end!r} is invalid: allowed 'hold', 'goal'")
    points = [("start", i) for i in range(D + 1)] + [("knot", k) for k in range(knots)] + tail
    T = len(points) - D
    rows = []
    for h in range(T * steps + 1):
        j = min(h // steps, T - 1)
        rows.append((j, Fraction(h, steps) - j))
    return Layout(D, knots, steps, end, tuple(points), tuple(rows))


def _table(rows: list[list[sp.Rational]], labels: list[str]) -> list[str]:
    """Rows of exact fractions, right-aligned in columns, each row after its label."""
    cells = [[str(x) for x in row] for row in rows]
    width = max(len(c) for row in cells for c in row)
    return [f"  {label}  " + "  ".join(c.rjust(width) for c in row) for label, row in zip(labels, cells)]


def describe(degree: int, knots: int, steps: int, end: End) -> list[str]:
    """The derived basis matrix, boundary coefficients and row layout as text (exact fractions)."""
    D = check_degree(degree)
    lay = layout(D, knots, steps, end)
    M = basis_matrix(D)
    lines = [f"B-spline of degree {D}: {knots} knots, {steps} rows per span, end={end!r}: "
             f"{lay.spans} spans, R = T*s + 1 = {lay.horizon} rows (kdt = steps*dt per span)",
             f"basis: B_i(t) = sum_k M[i,k] t^k on one span (t in [0, 1], q_0 oldest); columns t^0..t^{D}:"]
    lines += _table(M.tolist(), [f"B_{i}" for i in range(D + 1)])
    for side, point in (("start", "F"), ("goal", "G")):
        if side == "goal" and end != "goal":
            continue
        coeffs = boundary_points(D, side).coeffs
        lines.append(f"{side} points: {point}_i = sum_m C[i,m] * state_m * kdt^m; columns p, v, a, j:")
        lines += _table([list(row) for row in coeffs], [f"{point}_{i}" for i in range(D + 1)])
    return lines
