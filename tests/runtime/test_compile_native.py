"""torch.compile's ops on CPU run in the native node (its C++ CPU and autograd kernels), and what
the node leaves to Python (a value to explain, no gradients given) still gets Python's answer."""
from __future__ import annotations

import pytest
import torch

import tensorstep as ts
from tensorstep.runtime import native, ops

SPEC = ts.KernelSpec(horizon=8, dof=3, dtype="float64", difference="backward", start_index=True)


@pytest.fixture(scope="module")
def step():
    if native.wait() is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    return ts.load(SPEC)


def _inputs(step, B=4):
    g = torch.Generator().manual_seed(1)
    u = torch.randn(step.action_shape(B), generator=g, dtype=torch.float64)
    starts = [torch.randn(B + 1, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    index = torch.tensor([0, 2, 4, 2])
    return u, starts, index


def _kernels(op: str) -> str:
    return torch._C._dispatch_dump(f"tensorstep::{op}")


def test_a_compiled_loss_runs_the_node_kernels_and_its_gradient_matches_finite_differences(step):
    u, starts, index = _inputs(step)
    family = step.table.family

    def loss(u, p0, v0, a0):
        P, V, A, J = step(u, p0, v0, a0, 0.1, start_index=index)
        return P.square().sum() + 0.1 * J.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    x = u.clone().requires_grad_(True)
    for _ in range(2):  # the first call binds the kernel key; the second runs in the node
        (g,) = torch.autograd.grad(compiled(x, *starts), x)
    for op in (family, f"{family}_adjoint.needed"):
        kernels = {line.split(":")[0]: line for line in _kernels(op).splitlines()}
        # (registered from the node's built source, named after its artefact)
        assert native.ARTEFACT in kernels["CPU"] and native.ARTEFACT in kernels["AutogradCPU"], op
    # central differences of the eager loss, float64 (the adjoint against the forward)
    eps, flat = 1e-6, u.reshape(-1)
    fd = torch.empty_like(flat)
    with torch.no_grad():
        for i in range(flat.numel()):
            plus, minus = flat.clone(), flat.clone()
            plus[i] += eps
            minus[i] -= eps
            fd[i] = (loss(plus.view_as(u), *starts) - loss(minus.view_as(u), *starts)) / (2 * eps)
    assert torch.allclose(g.reshape(-1), fd, rtol=1e-6, atol=1e-7)


def test_what_the_node_kernels_leave_to_python(step):
    u, (p0, v0, a0), index = _inputs(step)
    key = step.op_key
    op = ops.ops_for(step.launcher)
    dt = torch.tensor([0.1], dtype=torch.float64)
    op.step(key, u, p0, v0, a0, None, index, dt)  # binds the key
    with pytest.raises(ValueError, match="dt"):  # a value the node refuses: Python's checks name it
        op.step(key, u, p0, v0, a0, None, index, torch.tensor([-0.1], dtype=torch.float64))
    with pytest.raises(IndexError, match="start_index"):
        op.step(key, u, p0, v0, a0, None, torch.tensor([0, 1, 9, 0]), dt)
    # no gradient given: zeros, of the per-trajectory shapes
    zeros = op.adjoint_needed(key, 4, [None] * 4, dt, [True, False, False, True])
    assert [tuple(z.shape) for z in zeros] == [tuple(u.shape), (4, 3)] and all(bool((z == 0).all()) for z in zeros)
    # a gradient wanted through the op itself: the Python autograd node, differentiable twice
    x = u.clone().requires_grad_(True)
    P = op.step(key, x, p0, v0, a0, None, index, dt)[0]
    (g,) = torch.autograd.grad(P.square().sum(), x, create_graph=True)
    assert g.shape == x.shape and g.requires_grad
