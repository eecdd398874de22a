"""The plain step's C kernels ask for a later trajectory's rows ahead of their loads and stores
(codegen/macros.py ``prefetches``, codegen/render.py ``prefetches``) where a column reads and writes
every row (integrators, B-splines), and not where loops over the rows stream them (a stencil's
interior). The requests change no value: on one thread, at a batch whose share asks for them, the
outputs and gradients are the dense float64 references' (tests/reference.py, tests/reference_bspline.py),
with the adjoint in both of an integrator's forms (codegen/render.py ``late_loads``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
import reference_bspline
import tensorstep as ts
from tensorstep.codegen import render
from tensorstep.codegen.arguments import table as argument_table
from tensorstep.codegen.driver import generate
from helpers import c_functions, scale_close

SPECS = [
    ts.KernelSpec(horizon=32, dof=7, dtype="float64", control="velocity"),
    # a duration per step, indexed start rows, layout bdh, snap
    ts.KernelSpec(horizon=24, dof=6, dtype="float64", control="jerk", integrator="exact", dt="per_step",
                  layout="bdh", start_index=True, order=4),
    # past 40 rows: the lane column rolled
    ts.KernelSpec(horizon=64, dof=3, dtype="float64", control="acceleration"),
    ts.KernelSpec(dof=7, dtype="float64", control="bspline", knots=8, steps=4, start_index=True),
]


def _batch_functions(spec: ts.KernelSpec) -> dict[str, str]:
    functions = c_functions(generate(spec, ("c",), ("core",)).source("c", "core"))
    return {name[len(spec.name) + 1:]: text for name, text in functions.items()
            if name.startswith(spec.name) and name.endswith("_batch")}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_row_a_column_reads_or_writes_is_asked_for(spec):
    """The forward asks for the actions' and each per-trajectory input's rows (at the row the index
    picks) and, unless it stores them as whole vectors, its outputs' rows to be written; each form of
    the adjoint for the output gradients' rows and its own gradient rows to be written (one per
    trajectory: the runtime sums an index's)."""
    table = argument_table(spec)
    batches = _batch_functions(spec)
    adjoints = [name for name in batches if name.startswith("adjoint")]
    assert adjoints
    forward = batches["forward_batch"]
    assert f"TS_PREFETCH_ROW({table.action.c_name} + (ahead) * U_SB, U_SB);" in forward
    for a in table.columns:
        index = f"({table.input(a.group).c_name} ? {table.input(a.group).c_name}[ahead] : (ahead))" if a.group else "(ahead)"
        assert f"TS_PREFETCH_ROW({a.c_name} + {index} * D_, D_);" in forward, a.name
    # a straight-line forward that stores its rows whole (render.whole_rows; tests/kernels/test_whole_rows.py)
    # does not ask for the outputs' rows to be written; the others do
    whole = "VYW0(" in forward
    for y in table.outputs:
        assert (f"TS_PREFETCH_ROW_WRITE({y.c_name} + (ahead) * Y_SB, Y_SB);" in forward) != whole, y.name
    for name in adjoints:
        for y in table.outputs:
            assert f"if ({y.grad_name}) TS_PREFETCH_ROW({y.grad_name} + (ahead) * Y_SB, Y_SB);" in batches[name]
        assert f"TS_PREFETCH_ROW_WRITE({table.action.grad_name} + (ahead) * U_SB, U_SB);" in batches[name]
        for a in table.differentiable[1:]:
            assert f"if ({a.grad_name}) TS_PREFETCH_ROW_WRITE({a.grad_name} + (ahead) * D_, D_);" in batches[name]
    # asked for only on a share with more than the gate's bytes of those rows, each optional one counted
    rows = " + ".join(["U_SB", *["D_"] * len(table.columns), *["Y_SB"] * len(table.outputs)])
    gate = "volatile const int64_t prefetch_end = (b_end - b_begin) * ({}) * (int64_t)sizeof(T) > TS_PREFETCH_FROM_BYTES"
    assert gate.format(rows) in forward
    adjoint_rows = " + ".join(["Y_SB"] * len(table.outputs) + ["U_SB"] + ["D_"] * (len(table.differentiable) - 1))
    for name in adjoints:
        assert gate.format(adjoint_rows) in batches[name], name
    for name in ["forward_batch", *adjoints]:
        assert "if (b < prefetch_end) {" in batches[name], name


@pytest.mark.parametrize("spec", [ts.KernelSpec(horizon=32, dof=7), ts.KernelSpec(horizon=32, dof=7, end="goal"),
                                  ts.KernelSpec(horizon=32, dof=7, accuracy=4, layout="bdh", start_index=True)],
                         ids=lambda s: s.name)
def test_a_stencil_whose_loops_stream_its_rows_asks_for_none(spec):
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    assert ("for (int64_t f = " in source or "for (int64_t r = " in source) and "TS_PREFETCH" not in source


def _operator(spec: ts.KernelSpec, dt: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Dense (M_u [K, H, N], M_s [K, H, 4]) from the references (a B-spline's from SciPy: P..J)."""
    if spec.control == "bspline":
        t = reference_bspline.trajectory(np.zeros((spec.knots, 1)), [np.zeros(1)] * 4, None, spec.degree,
                                         spec.steps, float(dt))
        return t.jac_knots, t.jac_start
    return reference.matrices(spec, dt.reshape(-1).tolist())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_rows_asked_for_ahead_leave_the_values(spec):
    """One thread, a batch whose share asks for rows (more than the gate's bytes of them) and, for an
    integrator, whose adjoint runs with every row loaded first when given every gradient (above
    ``LATE_LOADS_MAX_BYTES``) and each where used when given P's only: every output and the gradients of u and of
    the start rows (summed onto the rows the index picks) against the dense reference, every gradient
    given and P's only."""
    itemsize = 8
    action_bytes = spec.n_actions * spec.dof * itemsize
    row_bytes = spec.horizon * spec.dof * itemsize
    asked = action_bytes + 4 * spec.dof * itemsize + (spec.order + 1) * row_bytes  # the forward's rows: u, the starts, the outputs
    B = max(render.PREFETCH_FROM_BYTES // asked + 2 * render.PREFETCH_AHEAD + 3,
            render.LATE_LOADS_MAX_BYTES // ((spec.order + 1) * row_bytes + action_bytes) + 1)
    assert B * (row_bytes + action_bytes) <= render.LATE_LOADS_MAX_BYTES  # P's only: each row loaded where used
    gen = torch.Generator().manual_seed(1)
    S = B + 5 if spec.start_index else B
    u_bhd = torch.randn(B, spec.n_actions, spec.dof, generator=gen, dtype=torch.float64)
    u = u_bhd if spec.layout == "bhd" else u_bhd.transpose(1, 2).contiguous()
    starts = [torch.randn(S, spec.dof, generator=gen, dtype=torch.float64) for _ in range(4)]
    idx = torch.randint(0, S, (B,), generator=gen) if spec.start_index else None
    dt = (0.05 + 0.1 * torch.rand(spec.horizon, generator=gen, dtype=torch.float64) if spec.dt == "per_step"
          else torch.tensor(0.02, dtype=torch.float64))
    M_u, M_s = _operator(spec, dt)
    s = torch.stack(starts, 1)[idx if idx is not None else slice(None)].numpy()  # [B, 4, D]
    bhd = lambda y: y.detach().numpy() if spec.layout == "bhd" else y.detach().numpy().transpose(0, 2, 1)
    step = ts.load(spec)
    kwargs = {"j0": None, **({"start_index": idx} if idx is not None else {})}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        inputs = [u.clone().requires_grad_(), *(x.clone().requires_grad_() for x in starts)]
        outs = step(*inputs[:4], dt, **{**kwargs, "j0": inputs[4]})
        expected = np.einsum("khn,bnd->kbhd", M_u, u_bhd.numpy()) + np.einsum("khm,bmd->kbhd", M_s, s)
        assert len(outs) == len(expected)
        for k in range(len(outs)):
            scale_close(bhd(outs[k]), expected[k], 1e-12)
        for given in (len(outs), 1):
            grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) if k < given else None
                     for k, y in enumerate(outs)]
            got = torch.autograd.grad([y for y, g in zip(outs, grads) if g is not None],
                                      inputs, [g for g in grads if g is not None], retain_graph=True)
            g = np.stack([bhd(grads[k]) if k < given else np.zeros(expected[k].shape) for k in range(len(outs))])
            scale_close(bhd(got[0]), np.einsum("khn,kbhd->bnd", M_u, g), 1e-12)
            per_row = np.einsum("khm,kbhd->bmd", M_s, g)  # [B, 4, D]
            for m in range(4):
                want = np.zeros((S, spec.dof))
                np.add.at(want, idx.numpy() if idx is not None else np.arange(B), per_row[:, m])
                scale_close(got[1 + m].numpy(), want, 1e-12)
    finally:
        torch.set_num_threads(before)
