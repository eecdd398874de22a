"""torch.library custom ops: opcheck, torch.compile(fullgraph=True) with backward, double backward."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import tensorstep as ts
from tensorstep.runtime import ops  # registers the ops for opcheck and direct calls
from helpers import gradgradcheck64

SPECS = [
    ts.KernelSpec(horizon=8, dof=3, dtype="float64"),
    ts.KernelSpec(horizon=8, dof=3, dtype="float64", control="acceleration", integrator="exact", dt="per_step"),
    ts.KernelSpec(horizon=8, dof=3, dtype="float64", difference="backward", start_index=True),
]


def make(spec, B=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    step = ts.load(spec)
    S = B + 1 if spec.start_index else B
    u = torch.randn(B, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    starts = [torch.randn(S, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    dt = torch.tensor(0.1, dtype=torch.float64) if spec.dt == "uniform" else 0.05 + 0.1 * torch.rand(8, generator=g, dtype=torch.float64)
    kw = {"start_index": torch.tensor([0, 2, 4, 2])} if spec.start_index else {}
    ops.ops_for(step.launcher)  # registered here for direct calls (a compiled trace registers them itself)
    return step, u, starts, dt.requires_grad_(True), kw


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_opcheck_forward_and_adjoint(spec):
    step, u, (p0, v0, a0), dt, kw = make(spec)
    idx = kw.get("start_index")
    dt_k = dt.detach().reshape(spec.n_dt).requires_grad_(True)
    torch.library.opcheck(torch.ops.tensorstep.step.default, (step.op_key, u, p0, v0, a0, None, idx, dt_k))
    grads = [torch.randn(4, 8, 3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    grads[2] = None
    torch.library.opcheck(torch.ops.tensorstep.step_adjoint.default, (step.op_key, 4, grads, dt_k.detach()))


def trajectory_cost(step, kw):
    weights = (1.0, 0.1, 0.01, 0.001)

    def cost(u, p0, v0, a0, dt):
        return sum(w * y.square().sum() for w, y in zip(weights, step(u, p0, v0, a0, dt, **kw)))

    return cost


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_compile_fullgraph_matches_eager(spec):
    step, u, starts, dt, kw = make(spec)
    cost = trajectory_cost(step, kw)
    args = (u, *starts, dt)
    eager = cost(*args)
    eager_grads = torch.autograd.grad(eager, args)
    torch._dynamo.reset()
    compiled = torch.compile(cost, fullgraph=True, backend="aot_eager")
    value = compiled(*args)
    grads = torch.autograd.grad(value, args)
    assert torch.allclose(value, eager, rtol=1e-12)
    for a, b in zip(grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_with_changing_float_dt(backend):
    """An optimisation loop that anneals dt: the second float recompiles with a symbolic dt, which
    must trace without a graph break (fullgraph=True raises on one); outputs and gradients as eager,
    a tensor dt and its gradient too, and a bad float still refused on real data."""
    spec = SPECS[0]
    step, u, (p0, v0, a0), _, _ = make(spec)

    def outputs(u, p0, v0, a0, dt):
        return step(u, p0, v0, a0, dt)

    torch._dynamo.reset()
    compiled = torch.compile(outputs, fullgraph=True, backend=backend)
    for dt in (0.02, 0.03, 0.05, torch.tensor(0.04, dtype=torch.float64, requires_grad=True)):
        got, expected = compiled(u, p0, v0, a0, dt), outputs(u, p0, v0, a0, dt)
        weights = [torch.randn(y.shape, dtype=torch.float64) for y in expected]
        inputs = (u, p0, v0, a0) + ((dt,) if isinstance(dt, torch.Tensor) else ())
        g_got = torch.autograd.grad(got, inputs, weights)
        g_expected = torch.autograd.grad(expected, inputs, weights)
        for a, b in zip((*got, *g_got), (*expected, *g_expected)):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), dt
    with pytest.raises(ValueError, match="dt"):
        compiled(u, p0, v0, a0, -0.1)


def test_compile_inductor_cpu():
    spec = SPECS[0]
    step, u, starts, dt, kw = make(spec)
    cost = trajectory_cost(step, kw)
    torch._dynamo.reset()
    compiled = torch.compile(cost, fullgraph=True)
    args = (u, *starts, dt.detach())
    value = compiled(*args)
    (g,) = torch.autograd.grad(value, u)
    (g_eager,) = torch.autograd.grad(cost(*args), u)
    assert torch.allclose(g, g_eager, rtol=1e-10)


def test_custom_op_double_backward_and_vmap():
    spec = SPECS[0]
    step, u, (p0, v0, a0), dt, _ = make(spec, B=2)
    dt = dt.detach().reshape(1)
    f = lambda u, p0, v0, a0: torch.ops.tensorstep.step(step.op_key, u, p0, v0, a0, None, None, dt)
    assert gradgradcheck64(f, (u, p0, v0, a0))
    us = torch.randn(3, 2, 7, 3, dtype=torch.float64)
    batched = torch.vmap(lambda u: torch.stack(f(u, p0, v0, a0)))(us)
    looped = torch.stack([torch.stack(f(us[i], p0, v0, a0)) for i in range(3)])
    assert torch.equal(batched, looped)


def test_custom_op_checks_index_values():
    spec = SPECS[2]
    step, u, (p0, v0, a0), dt, _ = make(spec)
    bad = torch.tensor([0, 1, 9, 0])
    with pytest.raises(IndexError, match="start_index"):
        torch.ops.tensorstep.step(step.op_key, u, p0, v0, a0, None, bad, dt.detach().reshape(1))


def test_forward_mode_inside_compile_is_never_a_silent_zero():
    """Custom ops have no forward-mode rule: inside torch.compile, jvp must be right or raise."""
    from torch.func import jvp

    spec = SPECS[0]
    step, u, (p0, v0, a0), dt, _ = make(spec, B=2)
    u = u.detach()
    f = lambda u: step(u, p0.detach(), v0.detach(), a0.detach(), 0.1)[1]
    tangent = torch.ones_like(u)
    _, expected = jvp(f, (u,), (tangent,))
    assert float(expected.abs().sum()) > 0
    torch._dynamo.reset()
    _, outside = jvp(torch.compile(f, backend="aot_eager"), (u,), (tangent,))
    torch.testing.assert_close(outside, expected, rtol=1e-12, atol=0)
    torch._dynamo.reset()
    inside = torch.compile(lambda u: jvp(f, (u,), (tangent,))[1], backend="aot_eager")(u)  # falls back to eager
    torch.testing.assert_close(inside, expected, rtol=1e-12, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="forward-mode AD"):
        torch.compile(lambda u: jvp(f, (u,), (tangent,))[1], backend="aot_eager", fullgraph=True)(u)


def test_first_compilation_registers_the_ops():
    """A load leaves the torch.library ops unregistered (they cost ~6 ms); the first traced step registers them."""
    code = textwrap.dedent("""
        import sys, torch, tensorstep as ts
        step = ts.load(ts.KernelSpec(horizon=8, dof=3, dtype="float64"))
        print(hasattr(torch.ops.tensorstep, "step"), "tensorstep.runtime.ops" in sys.modules)
        u = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)
        z = torch.zeros(2, 3, dtype=torch.float64)
        cost = lambda u: sum(y.square().sum() for y in step(u, z, z, z, 0.1))
        value = torch.compile(cost, fullgraph=True, backend="aot_eager")(u)
        (grad,) = torch.autograd.grad(value, u)
        (eager,) = torch.autograd.grad(cost(u), u)
        print(hasattr(torch.ops.tensorstep, "step"), bool(torch.allclose(grad, eager, rtol=1e-12)))
    """)
    make(SPECS[0])  # the subprocess finds the kernels in this run's cache
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True", "True"]


def test_custom_ops_marker_is_what_torch_sets():
    from tensorstep.runtime import api

    def registered() -> bool:
        return True

    torch.compiler.assume_constant_result(registered)
    assert vars(registered) and vars(registered) == vars(api._custom_ops)
