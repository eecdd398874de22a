"""What users would run without tensorstep: the baselines `tensorstep bench` compares against.

* dense: cuRobo's CPU fallback: outputs are dense matrices applied to the stacked inputs
  (P = mask·p0 + n_mask·u, V/A/J = F_k·P, with the ghost points folded in), backward by
  autograd (transposed matmuls);
* slicing: the fastest pure-PyTorch formulation we could write: pad the point sequence with
  ghost and held points once, then each derivative is a weighted sum of shifted slices
  (position control), or cumulative sums (integration control);
* copy: a torch copy (clone, with allocation, like the op's outputs) of the bytes the op
  must move: read u and write the outputs, then read their gradients and write u's.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

import tensorstep as ts
from tensorstep.codegen.stencils import stencil_offsets, uniform_weights

Step = Callable[..., tuple]


def dense_step(spec: ts.KernelSpec, dt: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> Step:
    """Y_k = M_u[k] @ u + M_s[k] @ s as batched matmuls (autograd does the transposes), the
    matrices on the inputs' device."""
    M = ts.operator_matrices(spec, dt)
    K, H, N = M["u"].shape
    M_u = torch.as_tensor(M["u"], dtype=dtype, device=device).reshape(K * H, N)
    M_s = torch.as_tensor(M["start"][:, :, :3], dtype=dtype, device=device).reshape(K * H, 3)

    def step(u, p0, v0, a0):
        s = torch.stack((p0, v0, a0), 1)  # [B, 3, D]
        Y = torch.matmul(M_u, u) + torch.matmul(M_s, s)  # [B, K*H, D]
        return Y.reshape(u.shape[0], K, H, -1).unbind(1)

    return step


def _taylor(p0, v0, a0, t: float):
    return p0 + t * v0 + (t * t / 2) * a0


def slicing_step(spec: ts.KernelSpec, dt: float) -> Step:
    """Shifted-slice stencils (position control, uniform dt, hold end) or cumsums (integration)."""
    if spec.dt != "uniform" or spec.layout != "bhd":
        raise ValueError("the slicing baseline covers uniform dt and the bhd layout")
    H = spec.horizon
    if spec.control == "position":
        if spec.end != "hold":
            raise ValueError("the slicing baseline covers end='hold'")
        stencils = []
        for k in range(1, spec.order + 1):
            offs = stencil_offsets(k, spec.accuracy[k - 1], spec.difference)
            weights = [float(x) / dt**k for x in uniform_weights(tuple(offs), k)]
            stencils.append((offs, weights))
        before = max(-min(o for offs, _ in stencils for o in offs), 0)
        after = max(max(o for offs, _ in stencils for o in offs), 0)

        def step(u, p0, v0, a0):
            ghosts = [_taylor(p0, v0, a0, -j * dt).unsqueeze(1) for j in range(before, 0, -1)]
            hold = u[:, -1:].expand(-1, after, -1)
            Q = torch.cat(ghosts + [p0.unsqueeze(1), u, hold], 1)  # points -before .. H-1+after
            outs = [Q[:, before : before + H]]
            for (offs, weights), start in zip(stencils, (v0, a0, None, None)):
                Y = sum(w * Q[:, before + o : before + o + H] for o, w in zip(offs, weights))
                first = start.unsqueeze(1) if start is not None else torch.zeros_like(Y[:, :1])
                outs.append(torch.cat([first, Y[:, 1:]], 1))
            return tuple(outs)

        return step
    c = spec.control_order

    def integrate(u, p0, v0, a0):
        starts = [p0, v0, a0, torch.zeros_like(p0)]
        Y: list = [None] * (spec.order + 1)
        Y[c] = torch.cat([starts[c].unsqueeze(1), u], 1)
        for k in range(c - 1, -1, -1):
            if spec.integrator == "semi_implicit_euler":
                incr = dt * Y[k + 1][:, 1:]
            else:
                incr = sum((dt**m / math.factorial(m)) * Y[k + m][:, :-1] for m in range(1, c - k))
                incr = incr + (dt ** (c - k) / math.factorial(c - k)) * Y[c][:, 1:]
            Y[k] = torch.cat([starts[k].unsqueeze(1), starts[k].unsqueeze(1) + torch.cumsum(incr, 1)], 1)
        for k in range(c + 1, spec.order + 1):
            Y[k] = torch.cat([starts[k].unsqueeze(1), torch.diff(Y[k - 1], dim=1) / dt], 1)
        return tuple(Y)

    return integrate


def copy_elements(spec: ts.KernelSpec, batch: int) -> int:
    """Elements the op moves per direction: u plus every output row (per batch and dof)."""
    return batch * spec.dof * (spec.n_actions + (spec.order + 1) * spec.horizon)


def copy_source(elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The source of a copy bound: every element written, nonzero. An unwritten ``torch.empty`` (or a
    ``torch.zeros``, from calloc) of this size is untouched pages on the CPU, which read as the
    system's zero page: a "copy" of it reads no memory, and the bound it gives is too low."""
    return torch.ones(elements, dtype=dtype, device=device)
