"""An independent float64 reference of docs/semantics.md (B-spline control) (B-spline trajectories), written from the text.

Nothing here calls tensorstep's code: the trajectory is `scipy.interpolate.BSpline` on the full
control polygon with a uniform knot vector, and the boundary points come from a numerical solve
of the Taylor-matching conditions with SciPy's own basis evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy.interpolate import BSpline

State = Sequence[np.ndarray]  # (p, v, a, j), each [dof]


def boundary_matrix(degree: int, side: str) -> np.ndarray:
    """C, [D+1, 4]: the span's points are F_i = Σ_m C[i, m] · state_m · kdt^m.

    One span (parameter t ∈ [0, 1], knots −D..D+1) must equal the Taylor polynomial about
    t0 = 0 ("start") or t0 = 1 ("goal"): its derivatives 0..D at t0 (in t) are
    state_k·kdt^k for k ≤ 3 and 0 above, a (D+1)×(D+1) linear system solved numerically.
    """
    D = degree
    basis = BSpline(np.arange(-D, D + 2, dtype=np.float64), np.eye(D + 1), D)
    t0 = 0.0 if side == "start" else 1.0
    A = np.stack([basis(t0, nu=k) for k in range(D + 1)])  # A[k, i] = B_i^(k)(t0)
    rhs = np.zeros((D + 1, 4))
    rhs[:4, :4] = np.eye(4)
    return np.linalg.solve(A, rhs)


def _state_points(state: State, C: np.ndarray, kdt: float) -> np.ndarray:
    """[D+1, dof] boundary points of one state."""
    return sum(C[:, [m]] * np.asarray(state[m], dtype=np.float64)[None, :] * kdt**m for m in range(4))


@dataclass
class Trajectory:
    """Outputs Y[k] ([R, dof], k = 0..3 for P, V, A, J) and the operator per dof.

    Y[k][:, d] = jac_knots[k] @ knots[:, d] + jac_start[k] @ start[:, d] + jac_goal[k] @ goal[:, d],
    with start/goal stacked as [4, dof] (p, v, a, j); jac_goal is None for end="hold".
    """

    Y: np.ndarray  # [4, R, dof]
    jac_knots: np.ndarray  # [4, R, n]
    jac_start: np.ndarray  # [4, R, 4]
    jac_goal: Optional[np.ndarray]  # [4, R, 4]


def trajectory(knots: np.ndarray, start: State, goal: Optional[State], degree: int, steps: int,
               dt: float) -> Trajectory:
    """docs/semantics.md (B-spline control) for one trajectory: knots [n, dof], start (p, v, a, j), goal (p, v, a, j) or None (hold)."""
    knots = np.asarray(knots, dtype=np.float64)
    n, D, s = knots.shape[0], degree, steps
    kdt = s * dt
    Cs = boundary_matrix(D, "start")
    # Control polygon and, per control point, its linear map from the inputs.
    rows_q = [_state_points(start, Cs, kdt), knots]
    src_knots = [np.zeros((D + 1, n)), np.eye(n)]
    src_start = [Cs * kdt ** np.arange(4), np.zeros((n, 4))]
    src_goal = [np.zeros((D + 1, 4)), np.zeros((n, 4))]
    if goal is None:
        rows_q.append(np.repeat(knots[-1:], D, axis=0))
        src_knots.append(np.repeat(np.eye(n)[-1:], D, axis=0))
        src_start.append(np.zeros((D, 4)))
        src_goal.append(np.zeros((D, 4)))
    else:
        Cg = boundary_matrix(D, "goal")
        rows_q.append(_state_points(goal, Cg, kdt))
        src_knots.append(np.zeros((D + 1, n)))
        src_start.append(np.zeros((D + 1, 4)))
        src_goal.append(Cg * kdt ** np.arange(4))
    Q = np.concatenate(rows_q)
    m = Q.shape[0]
    T = m - D
    # Uniform unclamped knot vector in span units: base interval [0, T]; row h at x = h/s
    # (exact at the knots, so SciPy picks the span to the right, as SPEC's ⌊h/s⌋ does).
    grid = np.arange(-D, m + 1, dtype=np.float64)
    x = np.arange(T * s + 1) / s
    curve = BSpline(grid, Q, D)
    basis = BSpline(grid, np.eye(m), D)
    Y = np.stack([curve(x, nu=k) / kdt**k for k in range(4)])
    W = np.stack([basis(x, nu=k) / kdt**k for k in range(4)])  # [4, R, m]
    return Trajectory(
        Y=Y,
        jac_knots=W @ np.concatenate(src_knots),
        jac_start=W @ np.concatenate(src_start),
        jac_goal=None if goal is None else W @ np.concatenate(src_goal),
    )
