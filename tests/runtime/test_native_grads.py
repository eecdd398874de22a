"""Incoming gradients of the native node: stride-0 gradients (what .sum() and .mean() losses give)
are used without copying them B times, and every mix of gradient forms gives the exact adjoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorstep as ts

import reference
from helpers import Inputs, make_spec, scale_close

PLAIN = make_spec(dict(difference="central"))
#: batch-invariant adjoints (dt shared by the batch), shared start rows, and one dt per trajectory
SPECS = [PLAIN, make_spec(dict(difference="central", start_index=True)),
         make_spec(dict(control="acceleration", integrator="semi_implicit_euler")),
         make_spec(dict(difference="backward", accuracy=2, dt="per_trajectory"))]


class _Ops(TorchDispatchMode):
    """Records each ATen op that writes memory (not a view) with the shapes of what it returns."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else [out]
        if not func.is_view:
            self.calls.append((str(func), [tuple(t.shape) for t in results if isinstance(t, torch.Tensor)]))
        return out


def test_sum_loss_gradients_are_not_copied_per_trajectory():
    """The gradients of a .sum() loss are one value expanded over [B, H, D]: the node runs the
    adjoint for one trajectory and broadcasts it, so no op writes a tensor of the outputs' shape."""
    step = ts.load(PLAIN)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    x = Inputs(PLAIN, batch=16, requires_grad=True)
    outs = step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)
    assert "NativeStep" in outs[0].grad_fn.name()
    loss = sum(y.sum() for y in outs)
    with _Ops() as ops:
        (gu,) = torch.autograd.grad(loss, [x.u])
    written = [(name, shape) for name, shapes in ops.calls for shape in shapes if shape == tuple(outs[0].shape)]
    assert written == [], f"the outputs' gradients were materialised: {written}"
    expect_u, _ = reference.apply_adjoint(PLAIN, [0.1], np.ones((4, *outs[0].shape)))
    scale_close(gu.numpy(), expect_u, 1e-12)


def _gradient_forms(shape: tuple[int, ...], gen: torch.Generator) -> list:
    """Output gradients of every form a loss gives: expanded scalars (.sum(), .mean()), a
    gradient that varies along the horizon but not over the batch, a dense one, and none."""
    B, H, D = shape
    along_h = torch.randn(1, H, D, generator=gen, dtype=torch.float64).expand(B, H, D)
    return [torch.tensor(1.0, dtype=torch.float64).expand(shape),
            torch.tensor(0.25 / (B * H * D), dtype=torch.float64).expand(shape),
            along_h, torch.randn(shape, generator=gen, dtype=torch.float64), None]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("mix", [(0, 1, 2, 4), (0, 3, 1, 2), (4, 4, 2, 4), (3, 2, 3, 1)])
def test_every_mix_of_gradient_forms_is_the_exact_adjoint(spec, mix, autograd_path):
    """Stride-0, batch-broadcast, dense and missing output gradients in any mix, on both autograd
    paths, against the dense transpose (float64); start rows shared through an index are summed."""
    step = autograd_path(ts.load(spec))
    x = Inputs(spec, batch=5, requires_grad=True)
    dt = torch.full((5,), 0.1, dtype=torch.float64) if spec.dt == "per_trajectory" else 0.1
    outs = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    forms = _gradient_forms(tuple(outs[0].shape), torch.Generator().manual_seed(sum(mix)))
    gs = [forms[m] for m in mix]
    used = [(y, g) for y, g in zip(outs, gs) if g is not None]
    wrt = [x.u, x.p0, x.v0, x.a0, x.j0]
    grads = torch.autograd.grad([y for y, _ in used], wrt, [g for _, g in used], allow_unused=True)

    g_np = np.stack([g.numpy() if g is not None else np.zeros(outs[0].shape) for g in gs])
    expect_u, per_batch = reference.apply_adjoint(spec, [0.1], g_np)
    expect_s = np.zeros((4, x.S, spec.dof))
    for b, row in enumerate(x.idx.tolist() if x.idx is not None else range(x.B)):
        expect_s[:, row] += per_batch[b]
    scale_close(grads[0].numpy(), expect_u, 1e-12)
    for m in range(4):
        scale_close(grads[1 + m].numpy(), expect_s[m], 1e-12)


def test_broadcast_gradients_accumulate_into_grad(autograd_path):
    """loss.backward() twice: u.grad holds twice the adjoint, a dense tensor of u's own strides."""
    step = autograd_path(ts.load(PLAIN))
    x = Inputs(PLAIN, batch=4, requires_grad=True)
    for _ in range(2):
        outs = step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)
        (outs[0].sum() + outs[2].mean()).backward()
    g = np.zeros((4, *outs[0].shape))
    g[0] = 1.0
    g[2] = 1.0 / outs[2].numel()
    expect_u, per_batch = reference.apply_adjoint(PLAIN, [0.1], g)
    assert x.u.grad.stride() == x.u.stride()
    scale_close(x.u.grad.numpy(), 2 * expect_u, 1e-12)
    scale_close(x.p0.grad.numpy(), 2 * per_batch[:, 0], 1e-12)
