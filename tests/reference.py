"""An independent float64 reference of docs/semantics.md, written directly from the text.

Nothing here calls tensorstep's code generator: finite-difference weights come from a
Vandermonde solve (not Fornberg or Lagrange formulas), integration from explicit loops.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np

DEFAULT_ACCURACY = {"backward": (1, 1, 1, 1), "central": (4, 4, 2, 2)}


def step_durations(spec, dt) -> np.ndarray:
    """dt_h for every row (uniform, or one trajectory's dt with dt="per_trajectory": repeated)."""
    dts = np.atleast_1d(np.asarray(dt, dtype=np.float64))
    return np.full(spec.horizon, dts[0]) if dts.size == 1 else dts.copy()


def vandermonde_weights(x: np.ndarray, k: int) -> np.ndarray:
    """w with Σ_i w_i x_i^m / m! = δ_mk, m = 0..n-1 (derivative k at 0).

    Solved exactly over rationals (the float nodes converted without rounding), since
    large stencils make the float64 Vandermonde system ill-conditioned.
    """
    return np.array(_exact_weights(tuple(float(xi) for xi in x), k))


@functools.lru_cache(maxsize=None)  # rows, dof and batch elements with the same nodes share a solve
def _exact_weights(x: tuple, k: int) -> tuple:
    n = len(x)
    xs = [Fraction(xi) for xi in x]
    A = [[xi**m / math.factorial(m) for xi in xs] + [Fraction(int(m == k))] for m in range(n)]
    for col in range(n):  # Gauss-Jordan elimination with exact arithmetic
        pivot = next(r for r in range(col, n) if A[r][col] != 0)
        A[col], A[pivot] = A[pivot], A[col]
        A[col] = [v / A[col][col] for v in A[col]]
        for r in range(n):
            if r != col and A[r][col] != 0:
                f = A[r][col]
                A[r] = [a - f * b for a, b in zip(A[r], A[col])]
    return tuple(float(A[r][n]) for r in range(n))


def _position(spec, u: np.ndarray, s: np.ndarray, dts: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Position control (docs/semantics.md); with end="goal" (docs/semantics.md, goal state and step durations) q_{H-1} = gp, row H-1 is the goal
    state g (gp, gv, ga, gj) and the points after the end are the goal's Taylor expansion."""
    H = spec.horizon
    goal = spec.end == "goal"
    accuracy = spec.accuracy
    t = np.concatenate([[0.0], np.cumsum(dts[1:])])

    def time(j: int) -> float:
        if j < 0:
            return j * dts[0]
        if j > H - 1:
            return t[H - 1] + (j - H + 1) * dts[H - 1]
        return t[j]

    def value(j: int) -> float:
        if j < 0:
            tj = j * dts[0]
            return s[0] + tj * s[1] + tj**2 / 2 * s[2] + tj**3 / 6 * s[3]
        if j == 0:
            return s[0]
        if goal and j >= H - 1:
            tk = (j - H + 1) * dts[H - 1]
            return g[0] + tk * g[1] + tk**2 / 2 * g[2] + tk**3 / 6 * g[3]
        return u[min(j, H - 1) - 1]

    Y = np.zeros((spec.order + 1, H))
    Y[: min(4, spec.order + 1), 0] = s[: min(4, spec.order + 1)]
    for h in range(1, H):
        if goal and h == H - 1:
            Y[: min(4, spec.order + 1), h] = g[: min(4, spec.order + 1)]
            continue
        Y[0, h] = u[h - 1]
        for k in range(1, spec.order + 1):
            a = accuracy[k - 1]
            if spec.difference == "backward":
                n = k + a
                pts = list(range(h - n + 1, h + 1))
            else:
                n = 2 * ((k + 1) // 2) - 1 + a
                pts = list(range(h - (n - 1) // 2, h + (n - 1) // 2 + 1))
            if spec.end == "one_sided" and pts[-1] > H - 1:
                n = k + a
                pts = list(range(H - n, H))
            w = vandermonde_weights(np.array([time(j) - t[h] for j in pts]), k)
            Y[k, h] = sum(wi * value(j) for wi, j in zip(w, pts))
    return Y


def _integration(spec, u: np.ndarray, s: np.ndarray, dts: np.ndarray) -> np.ndarray:
    H = spec.horizon
    c = {"velocity": 1, "acceleration": 2, "jerk": 3}[spec.control]
    Y = np.zeros((spec.order + 1, H))
    Y[:4, 0] = s
    for h in range(1, H):
        dt = dts[h]
        Y[c, h] = u[h - 1]
        for k in range(c - 1, -1, -1):
            if spec.integrator == "semi_implicit_euler":
                Y[k, h] = Y[k, h - 1] + dt * Y[k + 1, h]
            else:
                Y[k, h] = sum(dt**m / math.factorial(m) * Y[k + m, h - 1] for m in range(c - k))
                Y[k, h] += dt ** (c - k) / math.factorial(c - k) * Y[c, h]
        for k in range(c + 1, spec.order + 1):
            Y[k, h] = (Y[k - 1, h] - Y[k - 1, h - 1]) / dt
    return Y


def column(spec, u: np.ndarray, s: np.ndarray, dt, g=None) -> np.ndarray:
    """Outputs [order+1, H] of one column: actions u [N], start s [4] (p0, v0, a0, j0), goal
    g [4] (gp, gv, ga, gj; end="goal")."""
    dts = step_durations(spec, dt)
    if spec.control == "position":
        return _position(spec, u, s, dts, np.zeros(4) if g is None else g)
    return _integration(spec, u, s, dts)


def matrices(spec, dt) -> tuple[np.ndarray, np.ndarray]:
    """Dense (M_u [K, H, N], M_s [K, H, 4]) by probing the reference with unit vectors."""
    N = spec.n_actions
    K = spec.order + 1
    M_u = np.zeros((K, spec.horizon, N))
    M_s = np.zeros((K, spec.horizon, 4))
    for j in range(N):
        e = np.zeros(N)
        e[j] = 1.0
        M_u[:, :, j] = column(spec, e, np.zeros(4), dt)
    for m in range(4):
        e = np.zeros(4)
        e[m] = 1.0
        M_s[:, :, m] = column(spec, np.zeros(N), e, dt)
    return M_u, M_s


def goal_matrix(spec, dt) -> np.ndarray:
    """Dense M_g [K, H, 4] of the goal state (end="goal") by probing with unit vectors."""
    M_g = np.zeros((spec.order + 1, spec.horizon, 4))
    for m in range(4):
        M_g[:, :, m] = column(spec, np.zeros(spec.n_actions), np.zeros(4), dt, np.eye(4)[m])
    return M_g


def apply(spec, dt, u: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Batched reference: u [B, N, D] (bhd), start [B, 4, D] → outputs [K, B, H, D]."""
    M_u, M_s = matrices(spec, dt)
    return np.einsum("khn,bnd->kbhd", M_u, u) + np.einsum("khm,bmd->kbhd", M_s, start)


def apply_adjoint(spec, dt, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Batched reference transpose: output gradients [K, B, H, D] (bhd) → (gradient of u
    [B, N, D], per-batch gradient of the start state [B, 4, D])."""
    M_u, M_s = matrices(spec, dt)
    return np.einsum("khn,kbhd->bnd", M_u, grads), np.einsum("khm,kbhd->bmd", M_s, grads)
