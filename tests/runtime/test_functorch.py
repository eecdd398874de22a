"""torch.func transforms through the step agree with the dense reference."""
from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import reference
import tensorstep as ts
from helpers import ReferenceCase, as_bhd, scale_close

SPEC = ts.KernelSpec(horizon=6, dof=2, dtype="float64", control="acceleration", integrator="exact")
DT = 0.1


def dense():
    M_u, M_s = reference.matrices(SPEC, DT)
    return torch.from_numpy(M_u), torch.from_numpy(M_s)


def start(B=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, 2, generator=g, dtype=torch.float64) for _ in range(3)]


def test_jvp_vjp_jacobians_match_dense():
    step = ts.load(SPEC)
    p0, v0, a0 = start()
    f = lambda u: torch.stack(step(u, p0, v0, a0, DT))
    u = torch.randn(2, 5, 2, dtype=torch.float64)
    M_u, _ = dense()
    J_expected = torch.einsum("khn,bc,de->kbhdcne", M_u, torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    J_rev = jacrev(f)(u)
    J_fwd = jacfwd(f)(u)
    scale_close(J_rev.numpy(), J_expected.numpy(), 1e-12)
    scale_close(J_fwd.numpy(), J_expected.numpy(), 1e-12)
    t = torch.randn_like(u)
    _, out_t = jvp(f, (u,), (t,))
    scale_close(out_t.numpy(), torch.einsum("khn,bnd->kbhd", M_u, t).numpy(), 1e-12)
    _, pullback = vjp(f, u)
    g = torch.randn(4, 2, 6, 2, dtype=torch.float64)
    scale_close(pullback(g)[0].numpy(), torch.einsum("khn,kbhd->bnd", M_u, g).numpy(), 1e-12)


def test_grad_and_hessian_of_cost():
    step = ts.load(SPEC)
    p0, v0, a0 = start()
    M_u, M_s = dense()
    W = torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=torch.float64)

    def cost(u):
        return sum(w * (y**2).sum() for w, y in zip(W, step(u, p0, v0, a0, DT)))

    def cost_dense(u):
        s = torch.stack([p0, v0, a0, torch.zeros_like(p0)], 1)
        Y = torch.einsum("khn,bnd->kbhd", M_u, u) + torch.einsum("khm,bmd->kbhd", M_s, s)
        return (W[:, None, None, None] * Y**2).sum()

    u = torch.randn(2, 5, 2, dtype=torch.float64)
    scale_close(grad(cost)(u).numpy(), grad(cost_dense)(u).numpy(), 1e-12)
    scale_close(hessian(cost)(u).numpy(), hessian(cost_dense)(u).numpy(), 1e-12)


def test_vmap_matches_loop():
    step = ts.load(SPEC)
    us = torch.randn(3, 2, 5, 2, dtype=torch.float64)
    p0s = torch.randn(3, 2, 2, dtype=torch.float64)
    v0, a0 = start()[1:]
    batched = vmap(lambda u, p0: torch.stack(step(u, p0, v0, a0, DT)))(us, p0s)
    looped = torch.stack([torch.stack(step(us[i], p0s[i], v0, a0, DT)) for i in range(3)])
    assert torch.equal(batched, looped)


@pytest.mark.parametrize("fields", [dict(horizon=8, start_index=True), dict(horizon=8, end="goal", goal_index=True),
                                    dict(control="bspline", knots=3, steps=2, end="goal", goal_index=True,
                                         start_index=True)], ids=["start_index", "goal_index", "bspline"])
def test_vmap_of_u_with_one_trajectory_and_an_index(fields):
    """vmap over u alone with B=1 and an index: the folded index holds V equal entries (once a
    stride-0 view that the kernel read past its one element); each slice is the reference's."""
    spec = ts.KernelSpec(**fields, dof=2, dtype="float64")
    case, other = ReferenceCase(spec, B=1, seed=0), ReferenceCase(spec, B=1, seed=1)
    other.start, other.goal, other.idx, other.gidx = case.start, case.goal, case.idx, case.gidx
    step = ts.load(spec)
    states = case.tensors()[1:-1]
    ys = vmap(lambda u: torch.stack(case.call(step, u, *states, case.dt)[:4]))(torch.stack([case.u, other.u]))
    for slice_, each in zip(ys, (case, other)):
        for y, e in zip(slice_, each.expected()):
            scale_close(as_bhd(y, spec), e, 1e-12)
