"""Checks of the cuRobo v2 reference itself (reference_curobo_v2.py), against docs/compat_curobo_v2.md's claims.

The compat tests compare tensorstep.compat.curobo_v2 with that reference; these tests make sure
the reference says what the document says (polynomial exactness, boundary rows, unused inputs,
the basis against SciPy), so a disagreement later points at the compat layer, not at the reference.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.interpolate import BSpline

import reference_curobo_v2 as ref

D_OF = 3  # dof in every test


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _close(a, b, atol=1e-9, rtol=1e-9):
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


def _taylor(state, tau):
    """Position, velocity, acceleration, jerk at time tau of the cubic Taylor polynomial of (p, v, a, j)."""
    p, v, a, j = state
    return (
        p + v * tau + a * tau**2 / 2 + j * tau**3 / 6,
        v + a * tau + j * tau**2 / 2,
        a + j * tau,
        j + 0 * tau,
    )


def _columns(jac: np.ndarray, shape: tuple, index) -> np.ndarray:
    """The Jacobian's columns for the input entries selected by ``index`` (an index into ``shape``)."""
    sel = np.zeros(shape, dtype=bool)
    sel[index] = True
    return jac[:, sel.reshape(-1)]


def _rows(jac: np.ndarray, shape: tuple, index) -> np.ndarray:
    """The Jacobian's rows for the output entries selected by ``index``."""
    sel = np.zeros(shape, dtype=bool)
    sel[index] = True
    return jac[sel.reshape(-1), :]


# --------------------------------------------------------------------------------------------
# Position kernel
# --------------------------------------------------------------------------------------------


def clique_inputs(seed: int, H: int = 14, flags=(0, 1, 0, 1), B: int = 3) -> dict:
    """Random inputs: start table [4, d], goal/dt/flag tables [len(flags)], distinct indices per b."""
    rng = _rng(seed)
    Ns, Ng = 4, len(flags)
    return dict(
        u_act=rng.normal(size=(B, H - 4, D_OF)),
        start_p=rng.normal(size=(Ns, D_OF)),
        start_v=rng.normal(size=(Ns, D_OF)),
        start_a=rng.normal(size=(Ns, D_OF)),
        goal_p=rng.normal(size=(Ng, D_OF)),
        start_idx=rng.permutation(Ns)[:B],
        goal_idx=np.arange(B) % Ng,
        traj_dt=rng.uniform(0.05, 0.3, size=Ng),
        flag=np.array(flags, dtype=np.uint8),
        H=H,
    )


def _poly(coeffs: np.ndarray, tau: float, deriv: int = 0) -> np.ndarray:
    """Σ_m c_m τ^m (per dof, coeffs [deg+1, d]) differentiated ``deriv`` times."""
    out = np.zeros(coeffs.shape[1])
    for m in range(deriv, coeffs.shape[0]):
        out += coeffs[m] * np.prod(range(m - deriv + 1, m + 1)) * tau ** (m - deriv)
    return out


def _sample_polynomial(inp: dict, coeffs: list[np.ndarray]) -> dict:
    """Put trajectory b's polynomial c_b(r·Δt) at X[1] (x0), X[2..H−4] (u) and X[H−3] (L)."""
    H = inp["H"]
    for b, (s, g) in enumerate(zip(inp["start_idx"], inp["goal_idx"])):
        dt = inp["traj_dt"][g]
        inp["start_p"][s] = _poly(coeffs[b], 1 * dt)
        for r in range(2, H - 2):  # r = H−3 lands in u[A−1]; with the flag it is ignored
            inp["u_act"][b, r - 2] = _poly(coeffs[b], r * dt)
        inp["goal_p"][g] = _poly(coeffs[b], (H - 3) * dt)
    return inp


@pytest.mark.parametrize("degree", [3, 4])
def test_clique_exact_on_polynomials_at_interior_rows(degree):
    """Rows whose window X[h−2..h+2] lies in X[1..H−3] give the polynomial's derivatives exactly.

    The 5-point central stencils are exact up to degree 4 for V and J and 5 for A.
    """
    inp = clique_inputs(1)
    rng = _rng(2)
    coeffs = [rng.normal(size=(degree + 1, D_OF)) for _ in range(3)]
    inp = _sample_polynomial(inp, coeffs)
    H = inp["H"]
    P, V, A, J, _ = ref.clique_v2(**inp)
    for b, g in enumerate(inp["goal_idx"]):
        dt = inp["traj_dt"][g]
        for h in range(3, H - 4):
            for k, out in enumerate((P, V, A, J)):
                _close(out[b, h], _poly(coeffs[b], h * dt, k), atol=1e-8, rtol=1e-8)


def test_clique_not_exact_on_quintic():
    """Sanity of the exactness test above: a quintic breaks V's 4th-order stencil."""
    inp = clique_inputs(1)
    coeffs = [np.zeros((6, D_OF)) for _ in range(3)]
    for c in coeffs:
        c[5] = 1.0
    inp = _sample_polynomial(inp, coeffs)
    _, V, _, _, _ = ref.clique_v2(**inp)
    dt = inp["traj_dt"][inp["goal_idx"][0]]
    assert abs(V[0, 5, 0] - _poly(coeffs[0], 5 * dt, 1)[0]) > 1e-9


def test_clique_row_one_is_start_and_row_zero_is_ghost():
    inp = clique_inputs(3)
    P, _, _, _, out_dt = ref.clique_v2(**inp)
    for b, (s, g) in enumerate(zip(inp["start_idx"], inp["goal_idx"])):
        dt = inp["traj_dt"][g]
        x0, v0, a0 = inp["start_p"][s], inp["start_v"][s], inp["start_a"][s]
        _close(P[b, 1], x0, atol=0, rtol=0)
        _close(P[b, 0], x0 - dt * v0 - 1.5 * dt**2 * a0)
        assert out_dt[b] == inp["traj_dt"][g]


def test_clique_ghost_rows_form_the_documented_parabola():
    """X[−2..1] lie on one parabola in τ = r·Δt with q'(−Δt) = v0, q'' = a0 and q(Δt) = x0."""
    rng = _rng(4)
    H, dt = 12, 0.17
    x0, v0, a0 = rng.normal(size=(3, D_OF))
    X = ref.clique_extended_positions(x0, v0, a0, rng.normal(size=(H - 4, D_OF)), x0, dt, H)
    tau = np.array([-2, -1, 0, 1]) * dt
    pts = np.array([X[r] for r in (-2, -1, 0, 1)])
    for c in range(D_OF):
        fit, res, *_ = np.polyfit(tau, pts[:, c], 2, full=True)
        assert res.size == 0 or res[0] < 1e-24  # 4 points, 3 coefficients: no residual
        q = np.poly1d(fit)
        _close(q.deriv(1)(-dt), v0[c])
        _close(q.deriv(2)(-dt), a0[c])
        _close(q(dt), x0[c])


def test_clique_exact_on_the_start_parabola_from_row_zero():
    """A trajectory that IS the ghost parabola gets exact P, V, A (and J = 0) from row 0 on."""
    inp = clique_inputs(5, flags=(1, 1, 1, 1))
    H = inp["H"]
    parabolas = []
    for b, (s, g) in enumerate(zip(inp["start_idx"], inp["goal_idx"])):
        dt = inp["traj_dt"][g]
        x0, v0, a0 = inp["start_p"][s], inp["start_v"][s], inp["start_a"][s]
        c = np.array([x0 - 2 * dt * v0 - 2 * dt**2 * a0, v0, a0 / 2])  # q(τ), τ from row −1
        parabolas.append((c, dt))
        _close(_poly(c, 2 * dt), x0)  # row 1
        for r in range(2, H - 3):
            inp["u_act"][b, r - 2] = _poly(c, (r + 1) * dt)
        inp["goal_p"][g] = _poly(c, (H - 2) * dt)  # row H−3
    P, V, A, J, _ = ref.clique_v2(**inp)
    for b, (c, dt) in enumerate(parabolas):
        for h in range(0, H - 4):
            tau = (h + 1) * dt
            _close(P[b, h], _poly(c, tau), atol=1e-8)
            _close(V[b, h], _poly(c, tau, 1), atol=1e-8)
            _close(A[b, h], _poly(c, tau, 2), atol=1e-7)
            _close(J[b, h], np.zeros(D_OF), atol=1e-5)


def test_clique_flag_read_at_goal_idx_decides_what_is_unused():
    """Flag set: u[A−1] has no effect (zero Jacobian columns); flag clear: the goal has none."""
    inp = clique_inputs(6, flags=(0, 1, 0, 1), B=3)
    inp["goal_idx"] = np.array([1, 2, 3])  # flags 1, 0, 1
    A_rows = inp["H"] - 4
    u_shape, g_shape = inp["u_act"].shape, inp["goal_p"].shape
    out_shape = (3, inp["H"], D_OF)
    jac_u = np.concatenate(ref.affine_jacobian(ref.clique_v2, inp, "u_act")[:4])
    jac_g = np.concatenate(ref.affine_jacobian(ref.clique_v2, inp, "goal_p")[:4])
    stacked = (4,) + out_shape
    for b, flagged in enumerate([True, False, True]):
        last_u = _columns(jac_u, u_shape, (b, A_rows - 1))
        goal = _rows(_columns(jac_g, g_shape, inp["goal_idx"][b]), stacked, (slice(None), b))
        if flagged:
            assert np.all(last_u == 0)
            assert np.abs(goal).max() > 1
        else:
            assert np.abs(last_u).max() > 1
            assert np.all(goal == 0)


@pytest.mark.parametrize(
    "H, flags, ok",
    [(7, (0, 0, 0, 0), False), (8, (0, 0, 0, 0), True), (8, (0, 1, 0, 0), False), (9, (1, 1, 1, 1), True)],
)
def test_clique_validity(H, flags, ok):
    inp = clique_inputs(7, H=H, flags=flags)
    if ok:
        ref.clique_v2(**inp)
    else:
        with pytest.raises(ValueError, match="H >= 9"):
            ref.clique_v2(**inp)


def test_clique_refuses_wrong_action_rows():
    inp = clique_inputs(8)
    inp["u_act"] = inp["u_act"][:, 1:]
    with pytest.raises(ValueError, match="H-4"):
        ref.clique_v2(**inp)


# --------------------------------------------------------------------------------------------
# Jacobian helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrt", ["u_act", "start_p", "start_v", "start_a", "goal_p"])
def test_affine_jacobian_reproduces_the_map_and_agrees_with_differences(wrt):
    """f(x) = f(0) + J x for a random x (the map is affine), and J equals central differences."""
    inp = clique_inputs(9, H=10)
    x = inp[wrt]
    jac = ref.affine_jacobian(ref.clique_v2, inp, wrt)
    base = ref.clique_v2(**{**inp, wrt: np.zeros_like(x)})
    outs = ref.clique_v2(**inp)
    fd = ref.central_difference_jacobian(ref.clique_v2, inp, wrt)
    for mat, b0, o, m_fd in zip(jac, base, outs, fd):
        _close(b0.reshape(-1) + mat @ x.reshape(-1), o.reshape(-1))
        _close(m_fd, mat, atol=1e-6, rtol=1e-6)


def test_central_difference_jacobian_on_a_known_function():
    f = lambda x, y: (x**3 * y, np.sin(x))  # noqa: E731
    x = np.array([0.5, -1.5, 2.0])
    jac = ref.central_difference_jacobian(f, {"x": x, "y": 2.0}, "x")
    _close(jac[0], np.diag(6 * x**2), atol=1e-7, rtol=1e-7)
    _close(jac[1], np.diag(np.cos(x)), atol=1e-8)


# --------------------------------------------------------------------------------------------
# Acceleration kernel
# --------------------------------------------------------------------------------------------


def accel_inputs(seed: int, H: int = 11, B: int = 3) -> dict:
    rng = _rng(seed)
    return dict(
        u_act=rng.normal(size=(B, H, D_OF)),
        start_p=rng.normal(size=(4, D_OF)),
        start_v=rng.normal(size=(4, D_OF)),
        start_a=rng.normal(size=(4, D_OF)),
        start_idx=np.array([2, 0, 2])[:B],
        traj_dt=rng.uniform(0.02, 0.2, size=H + 2),
        H=H,
    )


def test_acceleration_matches_cumulative_sums():
    inp = accel_inputs(10)
    P, V, A, J = ref.acceleration_v2(**inp)
    dt = inp["traj_dt"][1 : inp["H"]]
    for b, s in enumerate(inp["start_idx"]):
        acc = inp["u_act"][b, :-1]
        vel = inp["start_v"][s] + np.cumsum(acc * dt[:, None], axis=0)
        pos = inp["start_p"][s] + np.cumsum(vel * dt[:, None], axis=0)
        _close(P[b], np.vstack([inp["start_p"][s], pos]))
        _close(V[b], np.vstack([inp["start_v"][s], vel]))
        _close(A[b], np.vstack([inp["start_a"][s], acc]), atol=0, rtol=0)
        jerk = np.diff(np.vstack([inp["start_a"][s], acc]), axis=0) / dt[:, None]
        _close(J[b], np.vstack([np.zeros(D_OF), jerk]))


def test_acceleration_closed_form_for_constant_action():
    """Uniform dt, u ≡ c (semi-implicit Euler): V[h] = v0 + c·h·dt, P[h] = p0 + v0·h·dt + c·dt²·h(h+1)/2."""
    inp = accel_inputs(11)
    dt, H = 0.07, inp["H"]
    inp["traj_dt"] = np.full(H, dt)
    c = np.array([0.3, -1.0, 2.0])
    inp["u_act"][:] = c
    P, V, _, _ = ref.acceleration_v2(**inp)
    h = np.arange(H)[:, None]
    for b, s in enumerate(inp["start_idx"]):
        p0, v0 = inp["start_p"][s], inp["start_v"][s]
        _close(V[b], v0 + c * h * dt)
        _close(P[b], p0 + v0 * h * dt + c * dt**2 * h * (h + 1) / 2)


def test_acceleration_unused_inputs():
    """u[H−1] and traj_dt[0] have no effect; row 0 is the start state with jerk 0."""
    inp = accel_inputs(12)
    base = ref.acceleration_v2(**inp)
    other = {**inp, "u_act": inp["u_act"].copy(), "traj_dt": inp["traj_dt"].copy()}
    other["u_act"][:, -1] += 5.0
    other["traj_dt"][0] = 9.0
    for x, y in zip(base, ref.acceleration_v2(**other)):
        _close(x, y, atol=0, rtol=0)
    changed = {**inp, "u_act": inp["u_act"].copy()}
    changed["u_act"][:, -2] += 5.0  # sanity: the last used action does matter
    assert not np.allclose(base[2], ref.acceleration_v2(**changed)[2])
    P, V, A, J = base
    for b, s in enumerate(inp["start_idx"]):
        _close(P[b, 0], inp["start_p"][s], atol=0, rtol=0)
        _close(V[b, 0], inp["start_v"][s], atol=0, rtol=0)
        _close(A[b, 0], inp["start_a"][s], atol=0, rtol=0)
        assert np.all(J[b, 0] == 0)


# --------------------------------------------------------------------------------------------
# B-spline basis and boundary points
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_cardinal_bspline_matches_scipy_basis_element(degree):
    """N_D and its derivatives 1..3 against SciPy's B-spline on knots 0..D+1, off the breakpoints."""
    element = BSpline.basis_element(np.arange(degree + 2), extrapolate=False)
    xs = np.linspace(0, degree + 1, 7 * (degree + 1) + 1)
    xs = xs[np.abs(xs - np.round(xs)) > 1e-3]
    for k in range(4):
        expected = element.derivative(k)(xs) if k else element(xs)
        got = [ref.cardinal_bspline(degree, x, k) for x in xs]
        _close(got, expected, atol=1e-11, rtol=1e-11)
        pieces = [ref.cardinal_bspline_piece(degree, x, int(np.floor(x)), k) for x in xs]
        _close(pieces, expected, atol=1e-11, rtol=1e-11)
    assert ref.cardinal_bspline(degree, -0.5) == 0 == ref.cardinal_bspline(degree, degree + 1.5)


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_span_basis_partition_of_unity(degree):
    for t in np.linspace(0, 1, 11):
        _close(ref.span_basis(degree, t).sum(), 1.0, atol=1e-13)
        assert np.all(ref.span_basis(degree, t) >= -1e-15)
        for k in (1, 2, 3):
            _close(ref.span_basis(degree, t, k).sum(), 0.0, atol=1e-12)


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_consecutive_spans_join_with_continuous_derivatives(degree):
    """Span j at t = 1 equals span j+1 at t = 0 in derivatives 0..D−1 (C^{D−1}); derivative D jumps."""
    q = _rng(13).normal(size=(degree + 2, D_OF))
    for k in range(degree + 1):
        left = ref.span_basis(degree, 1.0, k) @ q[:-1]
        right = ref.span_basis(degree, 0.0, k) @ q[1:]
        if k < degree:
            _close(left, right, atol=1e-11)
        else:
            assert not np.allclose(left, right)


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_boundary_points_span_is_the_taylor_polynomial(degree):
    """Σ B_i^{(k)}(t) F_i / kdt^k = the state's Taylor polynomial's k-th derivative at τ = t·kdt
    (the cubic one for D ≥ 4; for D = 3 the jerk term is dropped: the quadratic one)."""
    rng = _rng(14)
    state = tuple(rng.normal(size=(4, D_OF)))
    kdt = 0.37
    F = ref.boundary_points(*state, kdt, degree)
    used = state if degree > 3 else state[:3] + (np.zeros(D_OF),)
    for t in np.linspace(0, 1, 9):
        expected = _taylor(used, t * kdt)
        for k in range(4):
            _close(ref.span_basis(degree, t, k) @ F / kdt**k, expected[k], atol=1e-10)


# --------------------------------------------------------------------------------------------
# B-spline kernel
# --------------------------------------------------------------------------------------------


def bspline_inputs(seed: int, degree: int, s: int, n: int = 7, flags=(0, 1, 1), extra_rows: int = 0) -> dict:
    """Inputs for bspline_v2 with R = T·s + 1 + extra_rows; goal/dt/flag tables indexed by goal_idx."""
    rng = _rng(seed)
    T = n + degree + 1
    tables = {k: rng.normal(size=(4, D_OF)) for k in ("start_p", "start_v", "start_a", "start_j")}
    tables |= {k: rng.normal(size=(3, D_OF)) for k in ("goal_p", "goal_v", "goal_a", "goal_j")}
    return dict(
        u_act=rng.normal(size=(3, n, D_OF)),
        **tables,
        start_idx=np.array([3, 1, 0]),
        goal_idx=np.array([0, 1, 2]),
        traj_dt=rng.uniform(0.02, 0.1, size=3),
        flag=np.array(flags, dtype=np.uint8),
        R=T * s + 1 + extra_rows,
        degree=degree,
    )


def _state(inp: dict, prefix: str, idx: int) -> tuple:
    return tuple(inp[f"{prefix}_{c}"][idx] for c in "pvaj")


@pytest.mark.parametrize("degree", [3, 4, 5])
@pytest.mark.parametrize("s", [1, 3])
def test_bspline_row_zero_is_the_start_state(degree, s):
    inp = bspline_inputs(15, degree, s)
    P, V, A, J, _ = ref.bspline_v2(**inp)
    for b, si in enumerate(inp["start_idx"]):
        p, v, a, j = _state(inp, "start", si)
        _close(P[b, 0], p)
        _close(V[b, 0], v)
        _close(A[b, 0], a)
        _close(J[b, 0], j if degree > 3 else np.zeros(D_OF), atol=1e-8)


def test_bspline_degree_three_ignores_both_jerks():
    inp = bspline_inputs(16, 3, 2)
    base = ref.bspline_v2(**inp)
    other = {**inp, "start_j": inp["start_j"] + 3.0, "goal_j": inp["goal_j"] - 2.0}
    for x, y in zip(base, ref.bspline_v2(**other)):
        _close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize("degree", [3, 4, 5])
@pytest.mark.parametrize("s", [1, 2, 4])
def test_bspline_first_s_rows_do_not_depend_on_the_knots(degree, s):
    inp = bspline_inputs(17, degree, s)
    jac = np.concatenate(ref.affine_jacobian(ref.bspline_v2, inp, "u_act")[:4])
    rows = (4, 3, inp["R"], D_OF)
    assert np.all(_rows(jac, rows, (slice(None), slice(None), slice(0, s))) == 0)
    assert np.abs(_rows(jac, rows, (slice(None), slice(None), s + 1))).max() > 1e-3


@pytest.mark.parametrize("degree", [3, 4, 5])
@pytest.mark.parametrize("s", [1, 3])
def test_bspline_goal_met_at_row_n_plus_degree_times_s(degree, s):
    """With the flag: row (n+D)·s is the goal state, the last rows follow the goal's Taylor
    polynomial at the row spacing dt, rows from T·s on repeat the end state, u_{n−1} is unused."""
    n = 7
    inp = bspline_inputs(18, degree, s, n=n, flags=(1, 1, 1), extra_rows=2)
    P, V, A, J, _ = ref.bspline_v2(**inp)
    T = n + degree + 1
    for b, g in enumerate(inp["goal_idx"]):
        goal = _state(inp, "goal", g)
        if degree == 3:
            goal = goal[:3] + (np.zeros(D_OF),)
        dt = inp["traj_dt"][g]
        for k in range(s + 1):
            expected = _taylor(goal, k * dt)
            for out, e in zip((P, V, A, J), expected):
                _close(out[b, (n + degree) * s + k], e, atol=1e-8)
        for out in (P, V, A, J):
            _close(out[b, T * s :], np.broadcast_to(out[b, T * s], out[b, T * s :].shape), atol=0, rtol=0)
    jac = ref.affine_jacobian(ref.bspline_v2, inp, "u_act")
    for mat in jac[:4]:
        assert np.all(_columns(mat, inp["u_act"].shape, (slice(None), n - 1)) == 0)


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_bspline_without_flag_comes_to_rest_at_the_last_knot(degree):
    """Flag off: the goal has no effect; rows from (n+D)·s on are u_{n−1} with V = A = J = 0."""
    n, s = 6, 2
    inp = bspline_inputs(19, degree, s, n=n, flags=(0, 0, 0))
    P, V, A, J, _ = ref.bspline_v2(**inp)
    for b in range(3):
        tail = slice((n + degree) * s, None)
        _close(P[b, tail], np.broadcast_to(inp["u_act"][b, -1], P[b, tail].shape))
        for out in (V, A, J):
            _close(out[b, tail], 0.0, atol=1e-8)
    moved = {k: inp[k] + 1.0 for k in ("goal_p", "goal_v", "goal_a", "goal_j")}
    for x, y in zip((P, V, A, J), ref.bspline_v2(**{**inp, **moved})):
        _close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_bspline_reproduces_a_polynomial_from_start_to_goal(degree):
    """Start, knots and goal all taken from one cubic (a quadratic for D = 3, whose boundary
    points drop jerk): every row 0..T·s equals that polynomial. Control point k sits at
    ξ_k = k − (D−1)/2 knot spacings and is c(ξ_k·kdt) − σ·kdt²/2·c''(ξ_k·kdt)."""
    n, s = 6, 3
    inp = bspline_inputs(20, degree, s, n=n, flags=(1, 1, 1))
    T = n + degree + 1
    rng = _rng(21)
    sigma = (degree + 1) / 12
    polys = []
    for b, (si, g) in enumerate(zip(inp["start_idx"], inp["goal_idx"])):
        c = rng.normal(size=(4 if degree > 3 else 3, D_OF))
        polys.append(c)
        kdt = inp["traj_dt"][g] * s
        for name, k in zip(("p", "v", "a", "j"), range(4)):
            inp[f"start_{name}"][si] = _poly(c, 0.0, k)
            inp[f"goal_{name}"][g] = _poly(c, (n + degree) * kdt, k)
        for i in range(n - 1):
            tau = (degree + 1 + i - (degree - 1) / 2) * kdt
            inp["u_act"][b, i] = _poly(c, tau) - sigma * kdt**2 / 2 * _poly(c, tau, 2)
    outs = ref.bspline_v2(**inp)
    for b, g in enumerate(inp["goal_idx"]):
        dt = inp["traj_dt"][g]
        for h in range(T * s + 1):
            for k, out in enumerate(outs[:4]):
                _close(out[b, h], _poly(polys[b], h * dt, k), atol=1e-8)


def test_bspline_dt_read_at_goal_idx_with_floor():
    """dt = traj_dt[goal_idx[b]]; kdt uses max(dt, 1e−6) while out_dt is the raw dt."""
    inp = bspline_inputs(22, 4, 2)
    inp["traj_dt"] = np.array([0.05, 0.0, -1.0])
    inp["goal_idx"] = np.array([2, 0, 1])
    *outs, out_dt = ref.bspline_v2(**inp)
    _close(out_dt, [-1.0, 0.05, 0.0], atol=0, rtol=0)
    floored = {**inp, "traj_dt": np.array([0.05, 1e-6, 1e-6])}
    for x, y in zip(outs, ref.bspline_v2(**floored)[:4]):
        _close(x, y, atol=0, rtol=0)
    above = {**inp, "traj_dt": np.array([0.05, 2e-6, 2e-6])}  # sanity: the floor is 1e-6, no higher
    assert not np.allclose(outs[1], ref.bspline_v2(**above)[1])
    single = {**inp, "u_act": inp["u_act"][1:2], "start_idx": inp["start_idx"][1:2], "goal_idx": [0]}
    for x, y in zip(outs, ref.bspline_v2(**single)[:4]):
        _close(x[1], y[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    "degree, n, flag, ok",
    [
        (4, 4, 1, False), (4, 5, 1, True), (4, 3, 0, False),
        (4, 4, 0, True), (3, 3, 1, False), (6, 8, 0, False),
    ],
)
def test_bspline_refuses_spans_that_are_both_boundaries(degree, n, flag, ok):
    inp = bspline_inputs(23, min(degree, 5), 1, n=n, flags=(flag,) * 3)
    inp["degree"] = degree
    if ok:
        ref.bspline_v2(**inp)
    else:
        with pytest.raises(ValueError):
            ref.bspline_v2(**inp)


def test_bspline_refuses_zero_rows_per_span():
    inp = bspline_inputs(24, 4, 1)
    inp["R"] -= 1
    with pytest.raises(ValueError, match="s = 0"):
        ref.bspline_v2(**inp)


# --------------------------------------------------------------------------------------------
# get_bspline_interpolation
# --------------------------------------------------------------------------------------------


def _interp_inputs(inp: dict, dt: float, horizon, max_out: int) -> dict:
    keys = [f"{w}_{c}" for w in ("start", "goal") for c in "pvaj"]
    return dict(
        knots=inp["u_act"], **{k: inp[k] for k in keys}, start_idx=inp["start_idx"],
        goal_idx=inp["goal_idx"], interpolation_dt=np.array([dt, 99.0]), flag=inp["flag"],
        interpolated_horizon=np.asarray(horizon), max_out=max_out, degree=inp["degree"],
    )


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_interpolation_equals_the_forward_at_full_horizon(degree):
    inp = bspline_inputs(25, degree, 3, flags=(0, 1, 1))
    inp["traj_dt"][:] = 0.04
    got = ref.bspline_interpolation_v2(**_interp_inputs(inp, 0.04, [inp["R"] - 1] * 3, inp["R"]))
    for x, y in zip(got, ref.bspline_v2(**inp)):
        _close(x, y, atol=0, rtol=0)


def test_interpolation_per_trajectory_horizon():
    """Trajectory b: rows 0..T·s_b as the forward with R = H_b + 1, then its end state repeated;
    H_b is clamped to max_out − 1; dt[b] = interpolation_dt[0]."""
    degree, n = 4, 7
    T = n + degree + 1
    inp = bspline_inputs(26, degree, 1, n=n, flags=(1, 0, 1))
    max_out = 4 * T
    horizon = [2 * T + 1, 10 * T, 3 * T]  # s_b = 2, 3 (clamped: H_b = 4T − 1), 3
    inp["traj_dt"][:] = 0.03
    P, V, A, J, dt = ref.bspline_interpolation_v2(**_interp_inputs(inp, 0.03, horizon, max_out))
    _close(dt, [0.03] * 3, atol=0, rtol=0)
    for b, H_b in enumerate([2 * T + 1, 4 * T - 1, 3 * T]):
        alone = {
            **inp, "u_act": inp["u_act"][b : b + 1], "start_idx": inp["start_idx"][b : b + 1],
            "goal_idx": inp["goal_idx"][b : b + 1], "R": H_b + 1,
        }
        end = (H_b // T) * T
        for x, y in zip((P, V, A, J), ref.bspline_v2(**alone)[:4]):
            _close(x[b, : H_b + 1], y[0], atol=0, rtol=0)
            _close(x[b, end:], np.broadcast_to(y[0, end], x[b, end:].shape), atol=0, rtol=0)


def test_interpolation_refuses_zero_rows_per_span():
    inp = bspline_inputs(27, 4, 1)
    T = inp["u_act"].shape[1] + 5
    with pytest.raises(ValueError, match="s = 0"):
        ref.bspline_interpolation_v2(**_interp_inputs(inp, 0.03, [T - 1, T, T], 3 * T))
