"""An independent float64 reference of cuRobo v2's trajectory kernels, written from docs/compat_curobo_v2.md.

Plain loops that read like the document, one function per kernel. Nothing here imports
tensorstep, SymPy or SciPy: the B-spline basis comes from the truncated-power formula below.
Shapes follow the document: batch B, rows H (or R), dof d (the document writes D for both dof and
B-spline degree; here the degree is always ``degree``). Index and flag tables are read at
``start_idx[b]`` / ``goal_idx[b]``. Every kernel returns (P, V, A, J) as [B, rows, d] arrays;
``clique_v2``, ``bspline_v2`` and ``bspline_interpolation_v2`` also return ``out_dt`` [B].

Every map is affine in the actions/knots and the start and goal states (for fixed dt, flags and
indices), so ``affine_jacobian`` builds exact dense Jacobians from unit vectors;
``central_difference_jacobian`` is for dt, where the maps are not affine.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

DT_FLOOR = 1e-6  # kdt = max(dt, 1e-6)·s
BSPLINE_DEGREES = (3, 4, 5)


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _idx(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


# --------------------------------------------------------------------------------------------
# Position kernel (CliqueTensorStepIdxKernel)
# --------------------------------------------------------------------------------------------


def clique_extended_positions(
    x0: np.ndarray, v0: np.ndarray, a0: np.ndarray, u: np.ndarray, L: np.ndarray, dt: float, H: int
) -> dict[int, np.ndarray]:
    """The extended positions X[r], r = −2 … H+1, of one trajectory (a dict keyed by r).

    X[−2] = x0 − 3Δt·v0 − 1.5Δt²·a0, X[−1] = x0 − 2Δt·v0 − 2Δt²·a0, X[0] = x0 − Δt·v0 − 1.5Δt²·a0;
    X[1] = x0; X[r] = u[r−2] for 2 ≤ r ≤ H−4; X[r] = L for H−3 ≤ r ≤ H+1.
    """
    X: dict[int, np.ndarray] = {}
    X[-2] = x0 - 3 * dt * v0 - 1.5 * dt**2 * a0
    X[-1] = x0 - 2 * dt * v0 - 2 * dt**2 * a0
    X[0] = x0 - dt * v0 - 1.5 * dt**2 * a0
    X[1] = x0
    for r in range(2, H - 3):
        X[r] = u[r - 2]
    for r in range(H - 3, H + 2):
        X[r] = L
    return X


def clique_v2(u_act, start_p, start_v, start_a, goal_p, start_idx, goal_idx, traj_dt, flag, H: int):
    """Position kernel: row h of P is X[h]; V, A, J from the five samples X[h−2..h+2].

    With the window X₀..X₄ = X[h−2..h+2] and Δt = traj_dt[goal_idx[b]]:
    V = (X₀/12 − 2X₁/3 + 2X₃/3 − X₄/12)/Δt, A = (−X₀/12 + 4X₁/3 − 5X₂/2 + 4X₃/3 − X₄/12)/Δt²,
    J = (−X₀/2 + X₁ − X₃ + X₄/2)/Δt³. L = goal_p[goal_idx[b]] if flag[goal_idx[b]] else u[A−1].
    u_act is [B, H−4, d]; valid for H ≥ 9 (H ≥ 8 with the flag off). out_dt[b] = traj_dt[goal_idx[b]].
    """
    u_act = _f64(u_act)
    start_p, start_v, start_a, goal_p = map(_f64, (start_p, start_v, start_a, goal_p))
    traj_dt, flag = _f64(traj_dt).reshape(-1), np.asarray(flag).reshape(-1)
    start_idx, goal_idx = _idx(start_idx), _idx(goal_idx)
    B, n_act, d = u_act.shape
    if n_act != H - 4:
        raise ValueError(f"u_act has {n_act} rows; the position kernel needs H-4 = {H - 4}")
    if H < 8:
        raise ValueError(f"H = {H}: the position kernel needs H >= 9 (H >= 8 with the flag off)")
    P, V, A, J = (np.zeros((B, H, d)) for _ in range(4))
    out_dt = np.zeros(B)
    for b in range(B):
        s, g = start_idx[b], goal_idx[b]
        dt = float(traj_dt[g])
        use_goal = bool(flag[g])
        if use_goal and H < 9:
            raise ValueError(f"H = {H}: the position kernel needs H >= 9 with the flag set")
        L = goal_p[g] if use_goal else u_act[b, n_act - 1]
        X = clique_extended_positions(start_p[s], start_v[s], start_a[s], u_act[b], L, dt, H)
        for h in range(H):
            X0, X1, X2, X3, X4 = (X[h + k] for k in (-2, -1, 0, 1, 2))
            P[b, h] = X[h]
            V[b, h] = (X0 / 12 - 2 * X1 / 3 + 2 * X3 / 3 - X4 / 12) / dt
            A[b, h] = (-X0 / 12 + 4 * X1 / 3 - 5 * X2 / 2 + 4 * X3 / 3 - X4 / 12) / dt**2
            J[b, h] = (-X0 / 2 + X1 - X3 + X4 / 2) / dt**3
        out_dt[b] = dt
    return P, V, A, J, out_dt


# --------------------------------------------------------------------------------------------
# Acceleration kernel (AccelerationTensorStepIdxKernel)
# --------------------------------------------------------------------------------------------


def acceleration_v2(u_act, start_p, start_v, start_a, start_idx, traj_dt, H: int):
    """Acceleration kernel: row 0 = start state (jerk 0); for h ≥ 1, with dt[h] = traj_dt[h]:

    A[h] = u[h−1], V[h] = V[h−1] + A[h]·dt[h], P[h] = P[h−1] + V[h]·dt[h],
    J[h] = (A[h] − A[h−1])/dt[h]. u_act is [B, H, d]; u[H−1] and traj_dt[0] are never read.
    """
    u_act = _f64(u_act)
    start_p, start_v, start_a = map(_f64, (start_p, start_v, start_a))
    traj_dt, start_idx = _f64(traj_dt).reshape(-1), _idx(start_idx)
    B, n_act, d = u_act.shape
    if n_act != H:
        raise ValueError(f"u_act has {n_act} rows; the acceleration kernel needs H = {H}")
    if traj_dt.size < H:
        raise ValueError(f"traj_dt has {traj_dt.size} entries; the acceleration kernel needs >= {H}")
    P, V, A, J = (np.zeros((B, H, d)) for _ in range(4))
    for b in range(B):
        s = start_idx[b]
        P[b, 0], V[b, 0], A[b, 0] = start_p[s], start_v[s], start_a[s]
        for h in range(1, H):
            dt = traj_dt[h]
            A[b, h] = u_act[b, h - 1]
            V[b, h] = V[b, h - 1] + A[b, h] * dt
            P[b, h] = P[b, h - 1] + V[b, h] * dt
            J[b, h] = (A[b, h] - A[b, h - 1]) / dt
    return P, V, A, J


# --------------------------------------------------------------------------------------------
# B-spline basis (truncated powers) and boundary points
# --------------------------------------------------------------------------------------------


def _truncated_power_term(degree: int, m: int, x: float, deriv: int) -> float:
    """The k-th derivative of term m, (−1)^m C(D+1, m) (x − m)^D, on its active side x ≥ m.

    math.perm(D, k) = D·(D−1)·…·(D−k+1) is the factor the k-th derivative brings down.
    """
    return (-1) ** m * math.comb(degree + 1, m) * math.perm(degree, deriv) * (x - m) ** (degree - deriv)


def cardinal_bspline(degree: int, x: float, deriv: int = 0) -> float:
    """N_D^{(k)}(x), the cardinal B-spline with knots 0, 1, …, D+1, by truncated powers:

    N_D(x) = (1/D!) Σ_{m=0}^{D+1} (−1)^m C(D+1, m) (x − m)_+^D, zero outside [0, D+1);
    right-continuous where a derivative jumps ((y)_+^0 = 1 for y ≥ 0).
    """
    if not 0 <= x < degree + 1 or deriv > degree:
        return 0.0
    total = 0.0
    for m in range(degree + 2):
        if x - m >= 0:
            total += _truncated_power_term(degree, m, x, deriv)
    return total / math.factorial(degree)


def cardinal_bspline_piece(degree: int, x: float, piece: int, deriv: int = 0) -> float:
    """N_D^{(k)} as the polynomial of its piece [piece, piece+1], evaluated at any x.

    The truncated-power sum with the terms that are active on that piece, m = 0..piece:
    (1/D!) Σ_{m=0}^{piece} (−1)^m C(D+1, m) (x − m)^D. A span's row at t = 1 thus takes the
    span's own polynomial (the left limit), where ``cardinal_bspline`` would take the next piece.
    """
    if deriv > degree:
        return 0.0
    total = 0.0
    for m in range(piece + 1):
        total += _truncated_power_term(degree, m, x, deriv)
    return total / math.factorial(degree)


def span_basis(degree: int, t: float, deriv: int = 0) -> np.ndarray:
    """[B_0^{(k)}(t), …, B_D^{(k)}(t)] with B_i(t) = N_D(t + D − i), t ∈ [0, 1] on one span.

    Control point i of the span sees the piece [D − i, D − i + 1] of N_D. N_D is supported on
    [0, D+1]: the document calls it "centred", but a centred N_D shifted by D − i would not sum
    to 1, nor match ξ_i and σ of the boundary points.
    """
    return np.array(
        [cardinal_bspline_piece(degree, t + degree - i, degree - i, deriv) for i in range(degree + 1)]
    )


def boundary_points(p, v, a, j, kdt: float, degree: int) -> np.ndarray:
    """F_0..F_D [D+1, d] from a state (p, v, a, j), whose span is the state's Taylor polynomial.

    F_i = p + ξ_i·v·kdt + (ξ_i² − σ)/2·a·kdt² + (ξ_i³ − 3σξ_i)/6·j·kdt³,
    ξ_i = i − (D−1)/2, σ = (D+1)/12; the jerk term is dropped for D = 3 (cuRobo's quirk).
    """
    p, v, a, j = map(_f64, (p, v, a, j))
    sigma = (degree + 1) / 12
    F = []
    for i in range(degree + 1):
        xi = i - (degree - 1) / 2
        Fi = p + xi * v * kdt + (xi**2 - sigma) / 2 * a * kdt**2
        if degree != 3:
            Fi = Fi + (xi**3 - 3 * sigma * xi) / 6 * j * kdt**3
        F.append(Fi)
    return np.array(F)


def bspline_control_points(knots, start_state, goal_state, use_goal: bool, kdt: float, degree: int):
    """The control sequence of one trajectory (knots [n, d]; states are (p, v, a, j) tuples).

    Flag off: [F(start), u_0..u_{n−1}, u_{n−1} repeated D times] (the goal has no effect);
    flag on: [F(start), u_0..u_{n−2}, G(goal)] (u_{n−1} is never used). The document does not
    write G out: G is F's formula applied to the goal state, so the last span starts at the goal
    (row (n+D)·s, as the document says) and follows its Taylor polynomial.
    """
    knots = _f64(knots)
    F = boundary_points(*start_state, kdt, degree)
    if use_goal:
        G = boundary_points(*goal_state, kdt, degree)
        return np.concatenate([F, knots[:-1], G])
    tail = np.repeat(knots[-1:], degree, axis=0)
    return np.concatenate([F, knots, tail])


def bspline_row(h: int, s: int, T: int) -> tuple[int, float]:
    """Row h's span j = ⌊h/s⌋ and t = (h mod s)/s; if j ≥ T then j = T−1, t = 1."""
    j, t = h // s, (h % s) / s
    if j >= T:
        j, t = T - 1, 1.0
    return j, t


def _check_bspline(n: int, degree: int, use_goal: bool) -> None:
    if degree not in BSPLINE_DEGREES:
        raise ValueError(f"bspline_degree = {degree}; allowed: {BSPLINE_DEGREES}")
    if (use_goal and n <= degree) or (not use_goal and n <= degree - 1):
        raise ValueError(
            f"n = {n} knots with degree {degree}: a span would be both a start and a goal boundary"
        )


def bspline_trajectory(
    knots, start_state, goal_state, use_goal: bool, dt: float, s: int, rows: int, degree: int
) -> np.ndarray:
    """[4, rows, d] (P, V, A, J) of one trajectory, s rows per span, kdt = max(dt, 1e−6)·s:

    row h in span j (``bspline_row``) is Σ_i B_i^{(k)}(t) q_{j+i} / kdt^k, i = 0..D, k = 0..3.
    """
    knots = _f64(knots)
    n = knots.shape[0]
    T = n + degree + 1
    _check_bspline(n, degree, use_goal)
    if s < 1:
        raise ValueError(f"s = 0 rows per span (T = {T} spans)")
    kdt = max(dt, DT_FLOOR) * s
    q = bspline_control_points(knots, start_state, goal_state, use_goal, kdt, degree)
    out = np.zeros((4, rows, q.shape[1]))
    for h in range(rows):
        j, t = bspline_row(h, s, T)
        pts = q[j : j + degree + 1]
        for k in range(4):
            out[k, h] = span_basis(degree, t, k) @ pts / kdt**k
    return out


def _tables(*tables) -> tuple[np.ndarray, ...]:
    return tuple(_f64(x) for x in tables)


# --------------------------------------------------------------------------------------------
# B-spline kernel (BSplineIdxKernel) and get_bspline_interpolation
# --------------------------------------------------------------------------------------------


def bspline_v2(
    u_act, start_p, start_v, start_a, start_j, goal_p, goal_v, goal_a, goal_j,
    start_idx, goal_idx, traj_dt, flag, R: int, degree: int,
):
    """B-spline kernel: R rows, H = R−1, T = n + D + 1 spans, s = ⌊H/T⌋ rows per span.

    dt = traj_dt[goal_idx[b]] is the row spacing, kdt = max(dt, 1e−6)·s the knot spacing, the flag
    is flag[goal_idx[b]]; P = Σ B_i q_i, V = Σ B_i' q_i/kdt, A = Σ B_i'' q_i/kdt²,
    J = Σ B_i''' q_i/kdt³ over span j's points q_j..q_{j+D}. out_dt[b] = the raw dt.
    """
    u_act = _f64(u_act)
    starts = _tables(start_p, start_v, start_a, start_j)
    goals = _tables(goal_p, goal_v, goal_a, goal_j)
    traj_dt, flag = _f64(traj_dt).reshape(-1), np.asarray(flag).reshape(-1)
    start_idx, goal_idx = _idx(start_idx), _idx(goal_idx)
    B, n, d = u_act.shape
    s = (R - 1) // (n + degree + 1)
    P, V, A, J = (np.zeros((B, R, d)) for _ in range(4))
    out_dt = np.zeros(B)
    for b in range(B):
        si, g = start_idx[b], goal_idx[b]
        dt = float(traj_dt[g])
        start, goal = [x[si] for x in starts], [x[g] for x in goals]
        P[b], V[b], A[b], J[b] = bspline_trajectory(
            u_act[b], start, goal, bool(flag[g]), dt, s, R, degree
        )
        out_dt[b] = dt
    return P, V, A, J, out_dt


def bspline_interpolation_v2(
    knots, start_p, start_v, start_a, start_j, goal_p, goal_v, goal_a, goal_j,
    start_idx, goal_idx, interpolation_dt, flag, interpolated_horizon, max_out: int,
    degree: int = 4,
):
    """get_bspline_interpolation: per trajectory b, H_b = min(interpolated_horizon[b], max_out − 1),

    s_b = ⌊H_b/T⌋, kdt_b = max(interpolation_dt[0], 1e−6)·s_b; rows 0..max_out−1 follow the
    forward's rule with H_b (rows from T·s_b on repeat the end state); dt[b] = interpolation_dt[0].
    The flag is read at goal_idx[b], as in the forward.
    """
    knots = _f64(knots)
    starts = _tables(start_p, start_v, start_a, start_j)
    goals = _tables(goal_p, goal_v, goal_a, goal_j)
    flag = np.asarray(flag).reshape(-1)
    start_idx, goal_idx = _idx(start_idx), _idx(goal_idx)
    horizon = _idx(interpolated_horizon)
    dt = float(_f64(interpolation_dt).reshape(-1)[0])
    B, n, d = knots.shape
    P, V, A, J = (np.zeros((B, max_out, d)) for _ in range(4))
    for b in range(B):
        si, g = start_idx[b], goal_idx[b]
        s_b = min(int(horizon[b]), max_out - 1) // (n + degree + 1)
        start, goal = [x[si] for x in starts], [x[g] for x in goals]
        P[b], V[b], A[b], J[b] = bspline_trajectory(
            knots[b], start, goal, bool(flag[g]), dt, s_b, max_out, degree
        )
    return P, V, A, J, np.full(B, dt)


# --------------------------------------------------------------------------------------------
# Dense Jacobians
# --------------------------------------------------------------------------------------------


def _float_outputs(outputs) -> list[np.ndarray]:
    return [np.asarray(o, dtype=np.float64) for o in outputs]


def affine_jacobian(fn: Callable, inputs: Mapping[str, object], wrt: str) -> list[np.ndarray]:
    """Exact Jacobians of an affine map: column k = fn(wrt = e_k) − fn(wrt = 0).

    ``fn(**inputs)`` returns a tuple of arrays; the result has one [out.size, inputs[wrt].size]
    matrix per output (C order). Valid for u_act/knots and the start and goal tables, not for dt.
    """
    x = _f64(inputs[wrt])
    base = _float_outputs(fn(**{**inputs, wrt: np.zeros_like(x)}))
    jac = [np.zeros((o.size, x.size)) for o in base]
    for k in range(x.size):
        e = np.zeros(x.size)
        e[k] = 1.0
        for mat, o, b in zip(jac, _float_outputs(fn(**{**inputs, wrt: e.reshape(x.shape)})), base):
            mat[:, k] = (o - b).reshape(-1)
    return jac


def central_difference_jacobian(
    fn: Callable, inputs: Mapping[str, object], wrt: str, step: float = 1e-6
) -> list[np.ndarray]:
    """Jacobians by central differences: (fn(x + h e_k) − fn(x − h e_k)) / 2h, h = step·max(1, |x_k|)."""
    x = _f64(inputs[wrt])
    flat = x.reshape(-1)
    jac: list[np.ndarray] | None = None
    for k in range(flat.size):
        h = step * max(1.0, abs(flat[k]))
        plus, minus = flat.copy(), flat.copy()
        plus[k] += h
        minus[k] -= h
        hi = _float_outputs(fn(**{**inputs, wrt: plus.reshape(x.shape)}))
        lo = _float_outputs(fn(**{**inputs, wrt: minus.reshape(x.shape)}))
        if jac is None:
            jac = [np.zeros((o.size, flat.size)) for o in hi]
        for mat, a, b in zip(jac, hi, lo):
            mat[:, k] = ((a - b) / (2 * h)).reshape(-1)
    return jac or []
