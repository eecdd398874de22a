"""B-spline math (codegen/bspline.py) and its independent reference (reference_bspline.py);
semantics in docs/semantics.md, "B-spline control".

Closed form of the boundary points (docs/compat_curobo_v2.md): F_i = p + ξ_i·v·kdt + (ξ_i² − σ)/2·a·kdt²
+ (ξ_i³ − 3σξ_i)/6·j·kdt³, ξ_i = i − (D−1)/2, σ = (D+1)/12. Finding: it is EXACT for every
D = 3..7 for the start side (Taylor polynomial about the span's start). It is the blossom
(polar form) of the cubic at point i's D interior knots, whose centred offsets c have Σc = 0,
Σ_{a<b} c_a c_b / C(D,2) = −σ and e_3(c) = 0 by symmetry. For tensorstep's goal side (Taylor
polynomial about the span's END) the same formula holds with ξ_i shifted by −1,
ξ_i = i − (D+1)/2; applied unshifted to the goal it puts the goal state at the START of the
last span, which is cuRobo's convention (docs/compat_curobo_v2.md), not tensorstep's (docs/semantics.md).
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
from scipy.interpolate import BSpline

from tensorstep.codegen import bspline

import reference_bspline as ref

DEGREES = list(range(3, 8))
T_GRID = np.linspace(0.0, 1.0, 37)
T_OPEN = np.linspace(0.01, 0.99, 29)  # derivative D jumps at the knots: compare inside only


def poly_rows(M: sp.MatrixBase, t: np.ndarray) -> np.ndarray:
    """[len(t), D+1]: Σ_k M[i, k] t^k for every t and i."""
    Mf = np.array(bspline.as_floats(M))
    return np.vander(t, Mf.shape[1], increasing=True) @ Mf.T


def scipy_span_basis(D: int, t: np.ndarray, nu: int = 0) -> np.ndarray:
    """[len(t), D+1]: B_i^(nu)(t) = N_D^(nu)(t + D − i), N_D SciPy's cardinal B-spline on [0, D+1]."""
    N = BSpline.basis_element(np.arange(D + 2, dtype=np.float64))
    return np.stack([N(t + D - i, nu=nu) for i in range(D + 1)], axis=1)


def truncated_power(D: int, x: np.ndarray) -> np.ndarray:
    """N_D(x) = 1/D! Σ_j (−1)^j C(D+1, j) (x − j)_+^D."""
    return sum((-1) ** j * math.comb(D + 1, j) * np.maximum(x - j, 0.0) ** D
               for j in range(D + 2)) / math.factorial(D)


def closed_form(D: int, shift: int = 0) -> list[list[Fraction]]:
    """docs/compat_curobo_v2.md's coefficients [i][m], with ξ_i − shift in place of ξ_i."""
    sigma = Fraction(D + 1, 12)
    out = []
    for i in range(D + 1):
        xi = Fraction(2 * i - (D - 1), 2) - shift
        out.append([Fraction(1), xi, (xi**2 - sigma) / 2, (xi**3 - 3 * sigma * xi) / 6])
    return out


def as_fractions(coeffs) -> list[list[Fraction]]:
    return [[Fraction(int(c.p), int(c.q)) for c in row] for row in coeffs]


def random_state(rng: np.random.Generator, dof: int) -> list[np.ndarray]:
    return [rng.standard_normal(dof) for _ in range(4)]


# --- basis and derivatives ------------------------------------------------------------------


@pytest.mark.parametrize("D", DEGREES)
def test_basis_matches_scipy_and_truncated_power(D):
    got = poly_rows(bspline.basis_matrix(D), T_GRID)
    np.testing.assert_allclose(got, scipy_span_basis(D, T_GRID), rtol=0, atol=1e-13)
    tp = np.stack([truncated_power(D, T_GRID + D - i) for i in range(D + 1)], axis=1)
    np.testing.assert_allclose(got, tp, rtol=0, atol=1e-12)


@pytest.mark.parametrize("D", DEGREES)
def test_partition_of_unity_exact(D):
    M = bspline.basis_matrix(D)
    assert all(isinstance(x, sp.Rational) for x in M)
    assert [sum(M[:, k]) for k in range(D + 1)] == [1] + [0] * D


@pytest.mark.parametrize("D", DEGREES)
def test_derivative_matrices_match_scipy(D):
    for k in range(D + 2):
        Mk = bspline.derivative_matrix(D, k)
        t = T_OPEN if k >= D else T_GRID
        expected = scipy_span_basis(D, t, nu=k) if k <= D else np.zeros((len(t), D + 1))
        np.testing.assert_allclose(poly_rows(Mk, t), expected, rtol=0, atol=1e-11)
        if k > 0:  # derivatives of a partition of unity sum to zero, exactly
            assert [sum(Mk[:, c]) for c in range(D + 1)] == [0] * (D + 1)
    assert bspline.derivative_matrix(D, 0) == bspline.basis_matrix(D)


def test_invalid_arguments():
    for bad in (2, 8, 4.0, True):
        with pytest.raises(ValueError, match="degree"):
            bspline.basis_matrix(bad)
    with pytest.raises(ValueError, match="side"):
        bspline.boundary_points(4, "end")
    with pytest.raises(ValueError, match="order"):
        bspline.derivative_matrix(4, -1)
    with pytest.raises(ValueError, match="end"):
        bspline.layout(4, 3, 2, "one_sided")
    with pytest.raises(ValueError, match="knots"):
        bspline.layout(4, 0, 2, "hold")
    with pytest.raises(ValueError, match="steps"):
        bspline.layout(4, 3, 0, "goal")


# --- boundary points ------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["start", "goal"])
@pytest.mark.parametrize("D", DEGREES)
def test_boundary_span_is_taylor_polynomial(D, side):
    """Built with SciPy's basis, the span from F equals the Taylor polynomial and its 1st–3rd derivatives."""
    rng = np.random.default_rng(D)
    kdt = 0.37
    state = [rng.standard_normal() for _ in range(4)]
    C = np.array(bspline.boundary_points(D, side).as_floats())
    F = C @ (np.array(state) * kdt ** np.arange(4))
    # One span alone: knots −D..D+1, base interval [0, 1] (so t = 1 stays in this span).
    span = BSpline(np.arange(-D, D + 2, dtype=np.float64), F, D)
    t0 = 0.0 if side == "start" else 1.0
    tau = (T_GRID - t0) * kdt
    for k in range(4):
        taylor = sum(state[m] * tau ** (m - k) / math.factorial(m - k) for m in range(k, 4))
        np.testing.assert_allclose(span(T_GRID, nu=k) / kdt**k, taylor, rtol=0, atol=1e-12)
        np.testing.assert_allclose(span(t0, nu=k) / kdt**k, state[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("D", DEGREES)
def test_boundary_points_equal_closed_form(D):
    """Exact (Fractions) for every D: start as written, goal with ξ_i shifted by −1 (see module doc)."""
    start = bspline.boundary_points(D, "start")
    goal = bspline.boundary_points(D, "goal")
    assert (start.degree, start.side, goal.side) == (D, "start", "goal")
    assert as_fractions(start.coeffs) == closed_form(D)
    assert as_fractions(goal.coeffs) == closed_form(D, shift=1)
    assert as_fractions(goal.coeffs) != closed_form(D)  # cuRobo's goal (start of the last span) differs


@pytest.mark.parametrize("side", ["start", "goal"])
@pytest.mark.parametrize("D", DEGREES)
def test_boundary_points_match_reference_solve(D, side):
    got = np.array(bspline.boundary_points(D, side).as_floats())
    np.testing.assert_allclose(got, ref.boundary_matrix(D, side), rtol=0, atol=1e-10)


# --- layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["hold", "goal"])
def test_layout_counts_and_rows(end):
    D, n, s = 4, 3, 3
    L = bspline.layout(D, n, s, end)
    m = (D + 1) + n + (D + 1 if end == "goal" else D)
    assert L.spans == m - D and L.horizon == L.spans * s + 1
    assert L.points[: D + 1] == tuple(("start", i) for i in range(D + 1))
    assert L.points[D + 1 : D + 1 + n] == tuple(("knot", k) for k in range(n))
    tail = L.points[D + 1 + n :]
    assert tail == (tuple(("goal", i) for i in range(D + 1)) if end == "goal" else (("knot", n - 1),) * D)
    assert L.rows[0] == (0, Fraction(0)) and L.rows[-1] == (L.spans - 1, Fraction(1))
    assert L.rows[s] == (1, Fraction(0)) and L.rows[s + 2] == (1, Fraction(2, 3))
    assert all(0 <= t <= 1 and Fraction(h, s) == j + t for h, (j, t) in enumerate(L.rows))


# --- the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("D", DEGREES)
@pytest.mark.parametrize("s", [1, 3, 4])
def test_reference_boundaries(D, s):
    rng = np.random.default_rng(10 * D + s)
    n, dof, dt = 5, 3, 0.05
    knots = rng.standard_normal((n, dof))
    start, goal = random_state(rng, dof), random_state(rng, dof)
    tr = ref.trajectory(knots, start, goal, D, s, dt)
    np.testing.assert_allclose(tr.Y[:, 0], np.stack(start), rtol=0, atol=1e-9)
    np.testing.assert_allclose(tr.Y[:, -1], np.stack(goal), rtol=0, atol=1e-9)
    hold = ref.trajectory(knots, start, None, D, s, dt)
    np.testing.assert_allclose(hold.Y[:, 0], np.stack(start), rtol=0, atol=1e-9)
    # The last span is D+1 copies of u_{n−1}: at rest there (every one of its rows).
    rest = hold.Y[:, -(s + 1):]
    np.testing.assert_allclose(rest[0], np.broadcast_to(knots[-1], rest[0].shape), rtol=0, atol=1e-12)
    np.testing.assert_allclose(rest[1:], 0.0, rtol=0, atol=1e-9)
    assert tr.Y.shape[1] == (n + D + 2) * s + 1 and hold.Y.shape[1] == (n + D + 1) * s + 1


@pytest.mark.parametrize("D", DEGREES)
def test_reference_reproduces_cubic(D):
    """A cubic given by its start and goal states and its own control points reproduces itself."""
    rng = np.random.default_rng(D)
    n, s, dt, dof = 4, 3, 0.1, 2
    kdt = s * dt
    coef = rng.standard_normal((4, dof))  # f(τ) = Σ coef_m τ^m
    T = n + D + 2
    m = T + D

    def f(tau: np.ndarray, k: int) -> np.ndarray:
        return sum(coef[q] * (math.factorial(q) // math.factorial(q - k)) * tau[:, None] ** (q - k)
                   for q in range(k, 4))

    # The cubic's control points: solve for the m points of the spline (span units, base [0, T]).
    x = np.linspace(0, T, 8 * T + 1)
    basis = BSpline(np.arange(-D, m + 1, dtype=np.float64), np.eye(m), D)(x)
    Q = np.linalg.lstsq(basis, f(x * kdt, 0), rcond=None)[0]
    knots = Q[D + 1 : D + 1 + n]
    tend = np.array([T * kdt])
    start = [f(np.zeros(1), k)[0] for k in range(4)]
    goal = [f(tend, k)[0] for k in range(4)]
    tr = ref.trajectory(knots, start, goal, D, s, dt)
    times = np.arange(T * s + 1) * dt
    for k in range(4):
        np.testing.assert_allclose(tr.Y[k], f(times, k), rtol=0, atol=1e-8 * 10**k)


@pytest.mark.parametrize("end", ["hold", "goal"])
def test_reference_jacobians_reproduce_outputs(end):
    rng = np.random.default_rng(7)
    D, n, s, dof, dt = 5, 4, 2, 3, 0.07
    knots = rng.standard_normal((n, dof))
    start = random_state(rng, dof)
    goal = random_state(rng, dof) if end == "goal" else None
    tr = ref.trajectory(knots, start, goal, D, s, dt)
    for k in range(4):
        y = tr.jac_knots[k] @ knots + tr.jac_start[k] @ np.stack(start)
        if goal is not None:
            y += tr.jac_goal[k] @ np.stack(goal)
        np.testing.assert_allclose(y, tr.Y[k], rtol=0, atol=1e-9)
    # Row 0 depends on the start only; with hold the last row is u_{n−1}.
    assert np.allclose(tr.jac_knots[:, 0], 0.0, rtol=0, atol=1e-12)
    assert np.allclose(tr.jac_start[:, 0], np.eye(4), rtol=0, atol=1e-12)
    if goal is None:
        assert tr.jac_goal is None
        np.testing.assert_allclose(tr.jac_knots[0, -1], np.eye(n)[-1], rtol=0, atol=1e-12)


# --- codegen's pieces assembled per docs/semantics.md (B-spline control) against the reference --------------------------


@pytest.mark.parametrize("end", ["hold", "goal"])
@pytest.mark.parametrize("D", DEGREES)
def test_layout_basis_and_boundaries_assemble_to_reference(D, end):
    """Exact rationals from codegen (layout + matrices + boundary points) equal the float reference."""
    rng = np.random.default_rng(D)
    n, s, dt, dof = 3, 3, 0.04, 2
    kdt = s * dt
    knots = rng.standard_normal((n, dof))
    start = random_state(rng, dof)
    goal = random_state(rng, dof) if end == "goal" else None
    L = bspline.layout(D, n, s, end)
    sides = {"start": start, "goal": goal}
    bp = {side: np.array(bspline.boundary_points(D, side).as_floats()) for side in sides}
    Q = np.stack([
        knots[i] if src == "knot" else sum(bp[src][i, q] * sides[src][q] * kdt**q for q in range(4))
        for src, i in L.points
    ])
    got = np.zeros((4, L.horizon, dof))
    for k in range(4):
        Mk = np.array(bspline.as_floats(bspline.derivative_matrix(D, k)))
        for h, (j, t) in enumerate(L.rows):
            w = Mk @ (float(t) ** np.arange(D + 1))
            got[k, h] = w @ Q[j : j + D + 1] / kdt**k
    expected = ref.trajectory(knots, start, goal, D, s, dt).Y
    for k in range(4):
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-9 * 10**k)
