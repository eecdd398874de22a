"""The experiment behind docs/numerics.md: LBFGS on a jerk-penalised reaching cost, float32 vs float64.

Cost (per trajectory, 7 dof, H=32, dt=0.02, central differences, start at rest):
    100·|P[H-1] - goal|² + w_v·|V|² + w_a·|A|² + w_j·|J|²
The optimum comes from a float64 least-squares solve on the dense operator
(ts.operator_matrices); LBFGS (strong Wolfe line search, PyTorch defaults otherwise)
starts from the start position held for the whole horizon. "raw" optimises absolute joint
positions (start and goal in [-2, 2] rad); "shifted" optimises displacements from the start
position (the same problem, moved so that the variables are small near the start).

    python docs/lbfgs_float32.py        # prints one line per case: excess above the optimum
"""
from __future__ import annotations

import numpy as np
import torch

import tensorstep as ts

H, D, DT, W_GOAL = 32, 7, 0.02, 100.0
WEIGHTS = [(0.0, 0.0, 1e-3), (0.0, 1e-3, 1e-2), (1e-2, 1e-4, 1e-6), (1e-2, 1e-4, 1e-3)]


def optimum(weights, m_u, m_s, p0, goal) -> tuple[float, float]:
    """(condition number of the Hessian, optimal cost) from the dense float64 operator."""
    rows = [np.sqrt(W_GOAL) * m_u[0][-1:]] + [np.sqrt(w) * m_u[k] for k, w in zip((1, 2, 3), weights)]
    a = np.vstack(rows)
    best = 0.0
    for d in range(D):
        s = np.array([p0[d], 0.0, 0.0, 0.0])
        b = np.concatenate([np.sqrt(W_GOAL) * (goal[d] - m_s[0][-1:] @ s)]
                           + [-np.sqrt(w) * (m_s[k] @ s) for k, w in zip((1, 2, 3), weights)])
        x = np.linalg.lstsq(a, b, rcond=None)[0]
        best += float(np.sum((a @ x - b) ** 2))
    return float(np.linalg.cond(a.T @ a)), best


def lbfgs(step, weights, p0, goal, shift: bool) -> float:
    """Final cost of LBFGS (20 outer steps of up to 1000 iterations each)."""
    offset = p0.clone() if shift else torch.zeros_like(p0)
    p0, goal = p0 - offset, goal - offset
    zero = torch.zeros_like(p0)

    def cost(u):
        P, V, A, J = step(u, p0, zero, zero, DT)
        return W_GOAL * (P[:, -1] - goal).square().sum() + sum(w * y.square().sum() for w, y in zip(weights, (V, A, J)))

    u = p0.expand(1, H - 1, D).clone().contiguous().requires_grad_(True)
    opt = torch.optim.LBFGS([u], max_iter=1000, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        f = cost(u)
        f.backward()
        return f

    for _ in range(20):
        opt.step(closure)
    return cost(u).item()


def problem() -> tuple[np.ndarray, np.ndarray, dict]:
    """The start and goal positions (seeded) and the dense float64 operator."""
    rng = np.random.default_rng(0)
    p0 = rng.uniform(-2, 2, D)
    goal = p0 + rng.uniform(-1, 1, D)
    return p0, goal, ts.operator_matrices(ts.KernelSpec(horizon=H, dof=D, dtype="float64"), DT)


def excess(weights, dtype: str, shift: bool) -> float:
    """Relative excess of LBFGS's final cost above the optimum, for one case."""
    p0, goal, m = problem()
    _, best = optimum(weights, m["u"], m["start"], p0, goal)
    step = ts.load(ts.KernelSpec(horizon=H, dof=D, dtype=dtype), "cpu")
    tdt = getattr(torch, dtype)
    f = lbfgs(step, weights, torch.tensor(p0[None], dtype=tdt), torch.tensor(goal[None], dtype=tdt), shift)
    return (f - best) / best


def main() -> None:
    p0, goal, m = problem()
    for weights in WEIGHTS:
        cond, best = optimum(weights, m["u"], m["start"], p0, goal)
        cells = [f"{dtype} {'shifted' if shift else 'raw'}: {100 * excess(weights, dtype, shift):.2g}%"
                 for dtype in ("float32", "float64") for shift in (False, True)]
        print(f"w_v, w_a, w_j = {weights}: Hessian cond {cond:.2g}, optimum {best:.4g}; " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
