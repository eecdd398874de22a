"""Reference joint-space costs in NumPy float64, written from their definitions (docs/semantics.md,
fused costs): for a term (kind, state) over the state's output y [B, H, D] and w = weight_d · row_weight_h,

    squared:  w · (y − target_d)²                                     (target only for position)
    bound:    w · (max(0, y − (upper_d − margin_d))² + max(0, (lower_d + margin_d) − y)²)

summed over every row and dof: one value per trajectory and term.
"""
from __future__ import annotations

import numpy as np

STATES = ("position", "velocity", "acceleration", "jerk", "snap")


def term(kind: str, y: np.ndarray, weight: np.ndarray, row_weight: np.ndarray | None = None,
         limit: np.ndarray | None = None, margin: np.ndarray | None = None,
         target: np.ndarray | None = None) -> np.ndarray:
    """One term's cost per trajectory [B]: y [B, H, D]; weight [D] or [B, D]; row_weight [H];
    limit [2, D] (lower, upper); margin [D]; target [B, D]."""
    B, H, D = y.shape
    w = np.broadcast_to(weight, (B, D))[:, None, :] * (np.ones(H) if row_weight is None else row_weight)[None, :, None]
    if kind == "squared":
        t = np.zeros((B, D)) if target is None else target
        pointwise = (y - t[:, None, :]) ** 2
    elif kind == "bound":
        m = np.zeros(D) if margin is None else margin
        over = np.maximum(0.0, y - (limit[1] - m))
        under = np.maximum(0.0, (limit[0] + m) - y)
        pointwise = over**2 + under**2
    else:
        raise ValueError(kind)
    return (w * pointwise).sum(axis=(1, 2))


def costs(terms: tuple, states: dict[str, np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """The cost output [B, T] for the terms (kind, state) over the states (name → [B, H, D]) and the
    keyword parameters by name (``<kind>_<state>_weight`` ...)."""
    out = []
    for kind, state in terms:
        p = lambda suffix: params.get(f"{kind}_{state}_{suffix}")
        out.append(term(kind, states[state], p("weight"), p("row_weight"), p("limit"), p("margin"),
                        params.get("squared_position_target") if (kind, state) == ("squared", "position") else None))
    return np.stack(out, axis=1)
