"""Test helpers: the variant grid, random inputs, layout conversion."""
from __future__ import annotations

import numpy as np
import torch

import tensorstep as ts

H, D = 7, 2


def scale_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """|actual - expected| ≤ rtol · max|expected| (derivative rows scale like 1/dt^k)."""
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(actual - expected).max())
    assert err <= rtol * scale, f"max error {err:.3e} > {rtol:.0e} x scale {scale:.3e}"

#: A grid that covers every option of SPEC §2/§3 (each row: KernelSpec overrides).
GRID = [
    dict(difference="backward", accuracy=1),
    dict(difference="backward", accuracy=2, dt="per_step"),
    dict(difference="backward", accuracy=(1, 2, 3), end="one_sided"),
    dict(difference="central"),
    dict(difference="central", end="one_sided"),
    dict(difference="central", accuracy=2, end="one_sided", dt="per_step"),
    dict(difference="central", accuracy=(2, 4, 2), dt="per_step"),
    dict(difference="central", accuracy=6, end="one_sided"),
    dict(difference="central", start_index=True, layout="bdh"),
    dict(difference="backward", accuracy=2, order=4),
    dict(difference="central", end="one_sided", order=4, dt="per_step"),
    dict(control="velocity"),
    dict(control="velocity", integrator="exact", dt="per_step", layout="bdh"),
    dict(control="acceleration"),
    dict(control="acceleration", integrator="exact", start_index=True),
    dict(control="acceleration", integrator="exact", dt="per_step", order=4),
    dict(control="jerk"),
    dict(control="jerk", integrator="exact", dt="per_step", start_index=True),
]


def grid_id(overrides: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in overrides.items()) or "default"


def make_spec(overrides: dict, dtype: str = "float64", horizon: int = H, dof: int = D) -> ts.KernelSpec:
    return ts.KernelSpec(horizon=horizon, dof=dof, dtype=dtype, **overrides)


def dt_value(spec, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    """A valid dt tensor for a spec: scalar (uniform) or H random durations (per step)."""
    gen = torch.Generator().manual_seed(seed)
    if spec.dt == "uniform":
        dt = torch.tensor(0.1, dtype=torch.float64)
    else:
        dt = 0.05 + 0.1 * torch.rand(spec.horizon, generator=gen, dtype=torch.float64)
    return dt.to(torch.float32 if spec.dtype == "float32" else torch.float64).requires_grad_(requires_grad)


class Inputs:
    """Random inputs for a spec; `reference_start` gives the start rows each batch element uses."""

    def __init__(self, spec, batch: int = 3, seed: int = 0, requires_grad: bool = False, with_j0: bool = True):
        gen = torch.Generator().manual_seed(seed)
        dtype = torch.float32 if spec.dtype == "float32" else torch.float64
        self.spec = spec
        self.B = batch
        self.S = batch + 2 if spec.start_index else batch
        N, Dn = spec.n_actions, spec.dof
        shape = (batch, N, Dn) if spec.layout == "bhd" else (batch, Dn, N)
        rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
        self.u = rnd(*shape)
        self.p0, self.v0, self.a0 = rnd(self.S, Dn), rnd(self.S, Dn), rnd(self.S, Dn)
        self.j0 = rnd(self.S, Dn) if with_j0 else None
        self.idx = torch.randint(0, self.S, (batch,), generator=gen) if spec.start_index else None

    def kwargs(self) -> dict:
        kw = {}
        if self.j0 is not None:
            kw["j0"] = self.j0
        if self.idx is not None:
            kw["start_index"] = self.idx
        return kw

    def numpy_u_bhd(self) -> np.ndarray:
        u = self.u.detach().double().numpy()
        return u if self.spec.layout == "bhd" else u.transpose(0, 2, 1)

    def numpy_start(self) -> np.ndarray:
        """[B, 4, D] start state of each batch element (j0 zero when absent)."""
        rows = [self.p0, self.v0, self.a0, self.j0 if self.j0 is not None else torch.zeros_like(self.p0)]
        s = torch.stack([r.detach().double() for r in rows], 1).numpy()
        return s[self.idx.numpy()] if self.idx is not None else s


def to_bhd(y: torch.Tensor, spec) -> np.ndarray:
    y = y.detach().double().numpy()
    return y if spec.layout == "bhd" else y.transpose(0, 2, 1)
