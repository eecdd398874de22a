"""The native autograd node: which calls take it, and that its gradients are the exact adjoint."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensorstep as ts

import reference
from helpers import Inputs, dt_value, make_spec, scale_close

SPEC = make_spec(dict(difference="central", start_index=True))


@pytest.fixture
def step():
    s = ts.load(SPEC)
    if s.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    return s


def node_name(t: torch.Tensor) -> str:
    return t.grad_fn.name()


def test_plain_calls_take_the_native_node(step):
    x = Inputs(SPEC, requires_grad=True)
    P, *_ = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    assert "NativeStep" in node_name(P)


def test_dt_gradient_and_forward_mode_take_the_python_path(step):
    x = Inputs(SPEC, requires_grad=True)
    dt = dt_value(SPEC, requires_grad=True)
    P, *_ = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    assert node_name(P) == "StepFunctionBackward"
    with torch.autograd.forward_ad.dual_level():
        u = torch.autograd.forward_ad.make_dual(x.u.detach(), torch.ones_like(x.u))
        P, *_ = step(u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
        assert torch.autograd.forward_ad.unpack_dual(P).tangent is not None


def test_gradients_equal_dense_transpose_with_shared_start_rows(step):
    """Gradients to u and to start rows shared by several batch elements (index_add), float64."""
    x = Inputs(SPEC, batch=5, requires_grad=True)
    x.idx = torch.tensor([0, 2, 2, 6, 0])
    outs = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    gen = torch.Generator().manual_seed(3)
    gs = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs]
    gs[2] = None  # an unused output
    used = [(y, g) for y, g in zip(outs, gs) if g is not None]
    grads = torch.autograd.grad([y for y, _ in used], [x.u, x.p0, x.v0, x.a0, x.j0], [g for _, g in used])

    g_np = np.stack([g.numpy() if g is not None else np.zeros(outs[0].shape) for g in gs])  # [K, B, H, D]
    expect_u, per_batch = reference.apply_adjoint(SPEC, [0.1], g_np)  # per_batch: [B, 4, D]
    expect_s = np.zeros((4, x.S, SPEC.dof))
    for b, row in enumerate(x.idx.tolist()):
        expect_s[:, row] += per_batch[b]
    scale_close(grads[0].numpy(), expect_u, 1e-12)
    for m in range(4):
        scale_close(grads[1 + m].numpy(), expect_s[m], 1e-12)


def test_only_requested_gradients_are_returned(step):
    x = Inputs(SPEC)
    x.u.requires_grad_(True)
    P, V, A, J = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    J.sum().backward()
    assert x.u.grad is not None and x.p0.grad is None and x.j0.grad is None


def test_double_backward_with_unused_outputs_is_exact(autograd_path):
    """create_graph with only one output used: the backward is itself differentiable
    (hessian-vector product of a quadratic in A), on both autograd paths."""
    step = autograd_path(ts.load(SPEC))
    x = Inputs(SPEC, batch=2, requires_grad=True)
    P, V, A, J = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    (g,) = torch.autograd.grad((A * A).sum(), x.u, create_graph=True)
    v = torch.randn_like(x.u)
    (hv,) = torch.autograd.grad(g, x.u, v)
    M_u, _ = reference.matrices(SPEC, [0.1])
    expected = np.einsum("hn,hm,bmd->bnd", M_u[2], M_u[2], 2 * v.numpy())
    scale_close(hv.numpy(), expected, 1e-12)


def test_native_off_by_environment_and_warm_load_without_sympy(tmp_path):
    code = textwrap.dedent(
        """
        import sys, tensorstep as ts
        s = ts.load(ts.KernelSpec(horizon=7, dof=2, dtype="float64"))
        print(s.native is not None, "sympy" in sys.modules, "jinja2" in sys.modules)
        """
    )
    run = lambda **env: subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                                       capture_output=True, text=True)
    ts.load(ts.KernelSpec(horizon=7, dof=2, dtype="float64"))  # the session cache holds node and kernel
    off = run(TENSORSTEP_NATIVE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "False", "False"]
    on = run()
    assert on.returncode == 0, on.stderr
    expected_native = "True" if ts.load(SPEC).native is not None else "False"
    assert on.stdout.split() == [expected_native, "False", "False"]


def test_unbuildable_node_falls_back_to_python_path_with_warning(tmp_path):
    """A C++ compiler that fails: one warning, and the step still works (Python autograd path)."""
    code = textwrap.dedent(
        """
        import warnings, torch, tensorstep as ts
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = ts.load(ts.KernelSpec(horizon=7, dof=2, dtype="float64"))
        u = torch.randn(1, 6, 2, dtype=torch.float64, requires_grad=True)
        z = torch.zeros(1, 2, dtype=torch.float64)
        s(u, z, z, z, 0.1)[0].sum().backward()
        print(s.native, u.grad is not None, sum("native autograd node" in str(w.message) for w in caught))
        """
    )
    env = dict(os.environ, TENSORSTEP_CACHE_DIR=str(tmp_path), CXX="/bin/false")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["None", "True", "1"]
