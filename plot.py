"""Pictures: a sample trajectory through each kernel (`tensorstep plot`), and `tensorstep bench
--plot`'s time per call against batch. Matplotlib is an optional extra (``tensorstep[plot]``),
imported only here and only when a picture is drawn.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from .codegen.spec import DERIVATIVE_NAMES

MISSING = "drawing needs matplotlib, which is not installed: pip install 'tensorstep[plot]'"


def pyplot() -> Any:
    """matplotlib.pyplot on a file-only backend; ImportError with the install line if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(MISSING) from None
    return plt


def sample_actions(spec: Any) -> list[list[float]]:
    """A smooth sample from rest, [N][D]: positions rising and coming back to rest (position and
    B-spline control; with end="goal" the goal is that rest), or one period of a sine as the
    action (integration controls); each dof a different amplitude."""
    n = spec.n_actions
    span = n + (1 if spec.end == "goal" else 0)  # the goal row closes the period
    rows = []
    for i in range(1, n + 1):
        x = i / span
        shape = math.sin(math.pi * x) ** 2 if spec.control in ("position", "bspline") else math.sin(2 * math.pi * x)
        rows.append([shape * (d + 1) / spec.dof for d in range(spec.dof)])
    return rows


def _dt_argument(spec: Any, dt: float, dtype: Any) -> Any:
    """dt as the spec takes it: a float, one per trajectory [1], or one per step [H]."""
    import torch

    if spec.dt == "uniform":
        return dt
    return torch.full((1 if spec.dt == "per_trajectory" else spec.n_dt,), dt, dtype=dtype)


def run_sample(spec: Any, dt: float, keywords: Optional[dict[str, Any]] = None) -> list[Any]:
    """The kernel's states for the sample on the CPU, each [H, D] (float64 NumPy): every state,
    whatever the spec writes. With ``keywords`` (a fused spec's cost parameters, nested lists by
    name), the sample's cost per term [T] comes last."""
    plain = spec.replace(costs=(), outputs=None)  # every state, no cost
    outs = [(y[0].T if spec.layout == "bdh" else y[0]).double().numpy() for y in _sample(plain, dt, {})]
    if keywords is not None and spec.costs:
        outs.append(_sample(spec, dt, keywords)[-1][0].double().numpy())
    return outs


def _sample(spec: Any, dt: float, keywords: dict[str, Any]) -> tuple[Any, ...]:
    """The outputs of a spec's kernel for the sample (one trajectory from rest), with the keyword
    tensors given as nested lists."""
    import torch

    from .runtime.api import load

    step = load(spec, "cpu")
    u = torch.tensor([sample_actions(spec)], dtype=step.dtype)  # [1, N, D]
    if spec.layout == "bdh":
        u = u.transpose(1, 2).contiguous()
    rest = [torch.zeros(1, spec.dof, dtype=step.dtype) for _ in range(4)]
    kw: dict[str, Any] = {"j0": rest[3], **{k: torch.tensor(v, dtype=step.dtype) for k, v in keywords.items()}}
    if spec.start_index:
        kw["start_index"] = torch.zeros(1, dtype=torch.int64)
    if spec.end == "goal":
        kw["goal"] = tuple(rest[:3])
        if spec.goal_index:
            kw["goal_index"] = torch.zeros(1, dtype=torch.int64)
    with torch.no_grad():
        return step(u, *rest[:3], _dt_argument(spec, dt, step.dtype), **kw)


def trajectories(specs: Sequence[Any], dt: float, path: str, labels: Optional[Sequence[str]] = None,
                 joints: Optional[Sequence[str]] = None, limits: Optional[dict[str, Any]] = None,
                 keywords: Optional[Any] = None) -> None:
    """One row per kernel, one column per output (P, V, A, J[, snap]) against time, one line per dof;
    ``limits`` (state → (lower, upper), one value per dof each) drawn dashed in each dof's colour.
    ``keywords(spec)``: a fused spec's cost parameters, whose terms' values on the sample go in its title."""
    plt = pyplot()
    columns = max(s.order for s in specs) + 1
    fig = plt.figure(figsize=(3.2 * columns, 2.6 * len(specs) + 0.4), layout="constrained")
    rows = fig.subfigures(len(specs), 1, squeeze=False)[:, 0]
    first = None
    for row, spec in enumerate(specs):
        fused = keywords is not None and bool(getattr(spec, "costs", ()))
        outs = run_sample(spec, dt, keywords(spec) if fused else None)
        title = labels[row] if labels else spec.name
        if fused:
            title += "\ncost on this sample: " + ", ".join(
                f"{kind}_{state} {value:.3g}" for (kind, state), value in zip(spec.costs, outs.pop()))
        rows[row].suptitle(title, fontsize=8, family="monospace")
        axes = rows[row].subplots(1, columns)
        first = first if first is not None else axes[0]
        for k in range(columns):
            if k >= len(outs):
                axes[k].axis("off")
                continue
            draw_state(axes[k], outs[k], dt, k, limits, joints)
            if row == len(specs) - 1:
                axes[k].set_xlabel("time (s)", fontsize=8)
    if specs[0].dof <= 10:
        first.legend(fontsize=6, loc="best")
    fig.suptitle(f"sample trajectory through each kernel (dt = {dt} s, from rest)", fontsize=10, weight="bold")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_state(ax: Any, y: Any, dt: float, k: int, limits: Optional[dict[str, Any]] = None,
               joints: Optional[Sequence[str]] = None) -> None:
    """State k (0 position … 4 snap) of one trajectory [H, D] or a batch [B, H, D] against time, one
    colour per dof (a batch's trajectories thin), and the state's limits (lower, upper) dashed."""
    import numpy as np

    y = np.asarray(y, dtype=float)
    batch = y[None] if y.ndim == 2 else y
    times = [h * dt for h in range(batch.shape[1])]
    state = DERIVATIVE_NAMES[k]
    bounds = (limits or {}).get(state)
    for d in range(batch.shape[2]):
        color = f"C{d % 10}"
        label = joints[d] if joints and d < len(joints) else f"dof {d}"
        for b, traj in enumerate(batch):
            ax.plot(times, traj[:, d], color=color, lw=1.2 if len(batch) == 1 else 0.7, alpha=1 if len(batch) == 1 else 0.6,
                    label=label if b == 0 else None)
        if bounds is not None:
            for side in bounds:
                ax.axhline(side[d], color=color, ls="--", lw=0.8, alpha=0.8)
    ax.set_title(state + (" (limits dashed)" if bounds is not None else ""), fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def states(ys: Sequence[Any], dt: float, path: str, limits: Optional[dict[str, Any]] = None,
           joints: Optional[Sequence[str]] = None, title: str = "") -> None:
    """Draw P, V, A, J[, S] (each [H, D], or a batch [B, H, D]: tensors or arrays) against time, one
    panel each, with the limits (state → (lower, upper), one value per dof each) dashed."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(ys), figsize=(3.2 * len(ys), 3.0), squeeze=False, layout="constrained")
    for k, y in enumerate(ys):
        y = y.detach().cpu().double().numpy() if hasattr(y, "detach") else y
        draw_state(axes[0, k], y, dt, k, limits, joints)
        axes[0, k].set_xlabel("time (s)", fontsize=8)
    axes[0, 0].legend(fontsize=6, loc="best")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: bench methods drawn, with their legend text and line style
BENCH_LINES = (
    ("tensorstep", "tensorstep (autograd)", "-"),
    ("kernels", "kernels only", ":"),
    ("dense", "dense matrices", "-"),
    ("slicing", "slicing (eager PyTorch)", "-"),
    ("compiled", "slicing, torch.compile (Inductor)", "-"),
    ("copy", "copy bound", "--"),
)


def bench_times(rows: Iterable[dict], path: str, title: str = "") -> None:
    """Forward+backward time per call against batch, one panel per (scheme, H, dtype, device)."""
    plt = pyplot()
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scheme"], r["horizon"], r["dtype"], r["device"]), []).append(r)
    if not groups:
        raise ValueError("--plot: no timings to draw")
    n = len(groups)
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(4.6 * cols, 3.6 * math.ceil(n / cols)),
                             squeeze=False, constrained_layout=True)
    for ax, ((scheme, H, dtype, device), group) in zip(axes.flat, groups.items()):
        group = sorted(group, key=lambda r: r["batch"])
        for key, label, style in BENCH_LINES:
            points = [(r["batch"], r[key]) for r in group if key in r]
            if points:
                ax.plot(*zip(*points), style, marker="o", ms=3, lw=1.3, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{scheme}, H={H}, {dtype}, {device}", fontsize=9)
        ax.set_xlabel("batch B", fontsize=8)
        ax.set_ylabel("seconds per forward+backward", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
