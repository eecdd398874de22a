"""`tensorstep bench`'s B-spline case: forward+backward of control="bspline" against a pure-PyTorch
B-spline (control polygon, sliding windows, basis matmul: what a user would write), the same
under torch.compile, and the copy bound of the bytes the op moves."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

import tensorstep as ts

from .baselines import copy_elements, copy_source
from .harness import COMPILE_BACKEND, DT, _fwd_bwd, format_time, machine, time_interleaved


@dataclasses.dataclass
class BSplineCase:
    batch: int = 4000
    degree: int = 4
    knots: int = 8
    steps: int = 4
    end: str = "hold"
    dtype: str = "float32"
    device: str = "cpu"
    dof: int = 7

    @property
    def spec(self) -> ts.KernelSpec:
        return ts.KernelSpec(dof=self.dof, control="bspline", degree=self.degree, knots=self.knots,
                             steps=self.steps, end=self.end, dtype=self.dtype)


def _tables(spec: ts.KernelSpec, dt: float, dtype: torch.dtype, device: torch.device) -> tuple:
    """The user's tables: per derivative k, the basis weights of the s rows of a span (and of the
    span's end, for the last row), over kdt^k; the start's boundary points over (p0, v0·kdt, a0·kdt²)."""
    from tensorstep.codegen.bspline import boundary_points, derivative_matrix

    D, s = spec.degree, spec.steps
    kdt = s * dt
    t = torch.arange(s + 1, dtype=torch.float64) / s
    powers = torch.stack([t**c for c in range(D + 1)], 1)  # [s+1, D+1]
    basis = []
    for k in range(spec.order + 1):
        Mk = torch.tensor([[float(x) for x in row] for row in derivative_matrix(D, k).tolist()], dtype=torch.float64)
        basis.append((powers @ Mk.T / kdt**k).to(dtype=dtype, device=device))  # [s+1, D+1]: rows t, columns i
    C = torch.tensor(boundary_points(D, "start").as_floats(), dtype=torch.float64)[:, :3]
    C = (C * torch.tensor([1.0, kdt, kdt**2], dtype=torch.float64)).to(dtype=dtype, device=device)  # [D+1, 3]
    return basis, C


def torch_bspline(spec: ts.KernelSpec, dt: float, dtype: torch.dtype, device: torch.device) -> Callable:
    """P, V, A, J (and snap) of a uniform B-spline, end='hold', in plain PyTorch."""
    if spec.end != "hold" or spec.dt != "uniform" or spec.layout != "bhd":
        raise ValueError("the PyTorch B-spline baseline covers end='hold', uniform dt and the bhd layout")
    basis, C = _tables(spec, dt, dtype, device)
    D, s = spec.degree, spec.steps

    def step(u, p0, v0, a0):
        start = torch.einsum("im,bmd->bid", C, torch.stack((p0, v0, a0), 1))  # F_0..F_D
        Q = torch.cat([start, u, u[:, -1:].expand(-1, D, -1)], 1)  # [B, m, dof]
        windows = Q.unfold(1, D + 1, 1)  # [B, T, dof, D+1]: span j's points
        outs = []
        for W in basis:
            Y = torch.matmul(windows, W[:s].T).transpose(2, 3)  # [B, T, s, dof]
            last = torch.matmul(windows[:, -1], W[s])  # the last span's end (t = 1)
            outs.append(torch.cat([Y.reshape(u.shape[0], -1, u.shape[2]), last.unsqueeze(1)], 1))
        return tuple(outs)

    return step


def case_callables(case: BSplineCase, inductor: bool = True) -> dict[str, Callable[[], None]]:
    spec = case.spec
    dtype = torch.float32 if case.dtype == "float32" else torch.float64
    dev = torch.device(case.device)
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype).to(dev)
    u = rnd(case.batch, case.knots, case.dof).requires_grad_(True)
    starts = [rnd(case.batch, case.dof) for _ in range(3)]
    grads = tuple(rnd(case.batch, spec.horizon, case.dof) for _ in range(spec.order + 1))
    step = ts.load(spec, dev)
    baseline = torch_bspline(spec, DT, dtype, dev)
    with torch.no_grad():  # the baseline computes the same trajectory (derivative k scales like 1/kdt^k)
        for k, (y, z) in enumerate(zip(step(u, *starts, DT), baseline(u, *starts))):
            error = float((y - z).abs().max() / z.abs().max().clamp(min=1))
            if error > (1e-5 if case.dtype == "float32" else 1e-12):
                raise AssertionError(f"the PyTorch B-spline disagrees with tensorstep in output {k}: {error:.1e}")
    launcher = step.launcher
    dt_k = torch.full((1,), DT, dtype=dtype, device=dev)

    def kernels() -> None:  # the generated forward and adjoint launched directly (no autograd)
        launcher.forward([u.detach(), *starts, None, None], dt_k)
        launcher.adjoint(grads, dt_k, case.batch, (False,) * 5)

    methods = {
        "tensorstep": _fwd_bwd(lambda u, *s: step(u, *s, DT), u, starts, grads),
        "kernels": kernels,
        "torch": _fwd_bwd(baseline, u, starts, grads),
    }
    if inductor:
        torch._dynamo.reset()
        compiled = _fwd_bwd(torch.compile(baseline, backend=COMPILE_BACKEND, dynamic=False), u, starts, grads)
        compiled()  # compiles the forward and backward graphs before any timing
        compiled()
        methods["compiled"] = compiled
    src = copy_source(copy_elements(spec, case.batch), dtype, dev)
    methods["copy"] = lambda: src.clone()
    return methods


def default_cases(device: str) -> list[BSplineCase]:
    """SPEC's case: B=4000, degree 4, 8 knots, 4 rows per span, 7 dof, float32."""
    return [BSplineCase(device=device)]


def run_cases(cases: Iterable[BSplineCase], echo: Callable[[str], None], budget_s: float = 0.6,
              inductor: bool = True) -> list[dict]:
    """The B-spline forward+backward table (interleaved timing, as the main table)."""
    echo(f"\nB-spline control, forward+backward (machine: {machine()}):")
    echo("")
    echo("| degree | knots | steps | R | B | dof | dtype | tensorstep | kernels only | PyTorch B-spline "
         "| same, torch.compile "
         "| copy bound | PyTorch / tensorstep | compiled / tensorstep | tensorstep / copy |")
    echo("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        t = time_interleaved(case_callables(case, inductor), case.device, budget_s)
        rows.append(dict(dataclasses.asdict(case), **t))
        co = t.get("compiled")
        compiled_ratio = f"{co / t['tensorstep']:.1f}×" if co else "n/a"
        echo(f"| {case.degree} | {case.knots} | {case.steps} | {case.spec.horizon} | {case.batch} | {case.dof} | "
             f"{case.dtype} | {format_time(t['tensorstep'])} | {format_time(t['kernels'])} | "
             f"{format_time(t['torch'])} | "
             f"{format_time(co) if co else 'n/a'} | {format_time(t['copy'])} | {t['torch'] / t['tensorstep']:.1f}× | "
             f"{compiled_ratio} | {t['tensorstep'] / t['copy']:.2f}× |")
    return rows
