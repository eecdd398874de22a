"""Fused costs beyond position control: torch.compile(fullgraph=True), vmap and torch.export of a
recurrence, a B-spline and an indexed "bdh" step; float32 CUDA source run on the host for layout "bdh", goal_index, end="one_sided" and snap.

The cases, data and references are test_costs.py's (the same specs, so their kernels are built once):
the states from tests/reference.py (NumPy), the terms from their definitions (tests/reference_costs.py),
the gradients against the plain step plus the terms in PyTorch.
"""
from __future__ import annotations

import pytest
import torch

import tensorstep as ts
from test_costs import _call, _data, _fused_against_composite, _grid_spec, _reference, _spec


#: AOT autograd (every backend's first stage) traces the op's fake kernel and its backward; inductor,
#: which also picks the strides of what it hands the op, on the transposed ("bdh") actions, where
#: they matter (test_costs.py runs it on position control)
@pytest.mark.parametrize("case, backend", [("jerk_exact", "aot_eager"), ("bspline_goal_per_trajectory", "aot_eager"),
                                           ("indexed_bdh", "inductor")])
def test_compile_vmap_and_export_of_a_recurrence_a_bspline_and_bdh(case, backend):
    """The cost under torch.compile(fullgraph=True), vmap and torch.export: the definitions' values
    (NumPy; a B-spline's: the eager call's, its states checked against SciPy elsewhere) and the
    eager gradient, to 1e-12 of the largest."""
    spec = _spec(case)
    x, params, dt = _data(spec)
    step = ts.load(spec)
    cost_of = lambda u: _call(step, spec, {**x, "u": u}, params, dt)[1]

    def loss(u):
        P, cost = _call(step, spec, {**x, "u": u}, params, dt)
        return P.square().sum() + cost.sum()

    def close(got, expected):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12 * float(expected.abs().max()))

    if spec.control == "bspline":
        expected = cost_of(x["u"])
    else:
        expected = torch.from_numpy(_reference(spec, x, params, dt)[1])
        close(cost_of(x["u"]), expected)

    u = x["u"].clone().requires_grad_()
    (g_eager,) = torch.autograd.grad(loss(u), u)
    compiled = torch.compile(lambda u: (cost_of(u), loss(u)), fullgraph=True, backend=backend)
    cost, total = compiled(u)
    close(cost.detach(), expected)
    (g_compiled,) = torch.autograd.grad(total, u)
    close(g_compiled, g_eager)

    scaled = torch.func.vmap(cost_of)(torch.stack([x["u"], 2 * x["u"]]))
    close(scaled[0], expected)
    close(scaled[1], cost_of(2 * x["u"]))

    class Cost(torch.nn.Module):
        def forward(self, u):
            return cost_of(u)

    close(torch.export.export(Cost(), (x["u"],)).module()(x["u"]), expected)


@pytest.mark.parametrize("case", ["position_one_sided_per_trajectory_indexed_bdh",
                                  "position_backward_goal_index_per_step_indexed", "jerk_euler_per_trajectory_snap"])
def test_cuda_float32_run_on_the_host_bdh_goal_index_one_sided_and_snap(case):
    """float32 CUDA source run on the host (tests/cuda_on_host.py): layout "bdh" with end="one_sided",
    goal_index, a bound on snap. P, the cost and the gradients of u, p0 and the target within 1e-5
    of the largest of the float64 plain step plus the terms from their definitions, on the values
    the kernel sees (the data rounded to float32)."""
    from cuda_on_host import host_step

    spec = _grid_spec(case).replace(outputs=("P",))
    x, params, dt = _data(spec)
    seen = lambda t: t.float().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    x = {k: tuple(map(seen, v)) if isinstance(v, tuple) else seen(v) for k, v in x.items()}
    params, dt = {k: seen(v) for k, v in params.items()}, seen(dt)
    _fused_against_composite(spec, x, params, dt, False, fused_step=host_step(spec.replace(dtype="float32")),
                             fused_dtype=torch.float32, tol=1e-5)
