"""An integrator's plain C adjoint in two forms chosen by a thread's share of the batch
(codegen/render.py ``late_loads``): each gradient row loaded where it is first used, for a share
whose rows fit in cache, and every row loaded first above ``LATE_LOADS_MAX_BYTES`` (the lane form
only: built with AVX-512). The same
statements in another order: the two forms give the same bits, each the dense reference's
gradients, with one thread and two, on both sides of the threshold."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen import render
from tensorstep.codegen.driver import generate
from tensorstep.runtime.launch import CpuBackend, Launcher

import reference
from helpers import c_functions, dt_value, scale_close

SPECS = [
    ts.KernelSpec(horizon=32, dof=7, dtype="float32", control="acceleration"),
    ts.KernelSpec(horizon=32, dof=7, dtype="float64", control="acceleration"),
    ts.KernelSpec(horizon=32, dof=7, dtype="float32", control="velocity"),
    ts.KernelSpec(horizon=24, dof=7, dtype="float64", control="jerk", order=4),
    # the ur5e example's: a duration per step, 6 dof
    ts.KernelSpec(horizon=40, dof=6, dtype="float64", control="jerk", integrator="exact", dt="per_step"),
]


def _launcher(spec: ts.KernelSpec, max_bytes: int, monkeypatch) -> Launcher:
    """The spec's C kernels built with the threshold at ``max_bytes`` (0: every share loads its rows
    first; huge: every share loads each row where it is used)."""
    monkeypatch.setattr(render, "LATE_LOADS_MAX_BYTES", max_bytes)
    g = generate(spec, targets=("c",))
    return Launcher(spec, CpuBackend(spec, source=g.sources[("c", "all")], metadata=dict(g.metadata)))


def _per_element_bytes(spec: ts.KernelSpec, given: int) -> int:
    """What the template's test counts for one trajectory: the given gradient rows, the actions' gradient."""
    itemsize = 4 if spec.dtype == "float32" else 8
    return (given * spec.horizon + spec.n_actions) * spec.dof * itemsize


def _gradients(spec: ts.KernelSpec, B: int, given: int) -> list:
    gen = torch.Generator().manual_seed(B + given)
    dtype = getattr(torch, spec.dtype)
    return [torch.randn(B, spec.horizon, spec.dof, generator=gen, dtype=dtype) if k < given else None
            for k in range(spec.order + 1)]


def _dt(spec: ts.KernelSpec) -> torch.Tensor:
    dt = dt_value(spec)
    return dt.to(getattr(torch, spec.dtype)) if dt.ndim else dt


def _reference(spec: ts.KernelSpec, grads: list) -> list[np.ndarray]:
    """u's and each start entry's gradient from the reference's dense matrices (float64)."""
    dt = dt_value(spec)
    M_u, M_s = reference.matrices(spec, dt.tolist() if dt.ndim else [float(dt)])
    given = [k for k, g in enumerate(grads) if g is not None]
    g = np.stack([grads[k].double().numpy() for k in given])
    gu = np.einsum("khn,kbhd->bnd", M_u[given], g)
    return [gu, *(np.einsum("kh,kbhd->bd", M_s[given, :, m], g) for m in range(4))]


def test_integrators_have_both_forms_and_stencils_and_cuda_neither():
    for spec in SPECS:
        source = generate(spec, ("c",), ("core",)).source("c", "core")
        functions = c_functions(source)
        batch = functions[f"{spec.name}_adjoint_batch"]
        assert f"{spec.name}_adjoint_late_batch(b_begin, b_end," in batch and "TS_LATE_LOADS_MAX_BYTES" in batch
        assert f"#define TS_LATE_LOADS_MAX_BYTES {render.LATE_LOADS_MAX_BYTES}LL" in source
        late = functions[f"{spec.name}_adjoint_late_batch"]
        # the lane form only (the per-dof loop gained nothing): the function and the test under TS_LANES
        assert "for (int64_t d = 0; d < D_; ++d)" not in late
        assert re.search(r"#if defined\(TS_LANES\)\n/\*[^/]*\*/\nstatic [^\n]*_adjoint_late_batch\(", source)
        assert re.search(r"\{\n#if defined\(TS_LANES\)\n[^#]*_adjoint_late_batch\(b_begin[^#]*#endif\n", batch)
        # its column starts the sweep at the last row: its first load is that row's
        first = next(line.strip() for line in late.splitlines() if "= VG" in line)
        assert f"({spec.horizon - 1});" in first, first
        # every load of the loaded-first form is in the late one, once (there whole where inside the
        # rows, VGW: render.whole_loads, tests/kernels/test_whole_loads.py)
        loads = sorted(re.sub(r"\bVGW(\d)", r"VG\1", line.strip()) for line in batch.splitlines() if "= VG" in line)
        assert loads and loads == sorted(line.strip() for line in late.splitlines() if "= VG" in line)
    position = ts.KernelSpec(horizon=32, dof=7, dtype="float32")
    for source in (generate(position, ("c",), ("core",)).source("c", "core"),
                   generate(SPECS[0], ("cuda",), ("core",)).source("cuda", "core")):
        assert "_late_batch" not in source and "LATE_LOADS" not in source


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_both_forms_give_the_same_bits_and_the_reference(spec, monkeypatch):
    """Each form forced by the threshold (0, and far above any batch), P's gradient only and every
    state's; both equal bit for bit, and to the reference's gradients."""
    forms = {name: _launcher(spec, max_bytes, monkeypatch) for name, max_bytes in (("first", 0), ("late", 1 << 60))}
    step = ts.load(spec)
    dt, nd = step._dt_tensor(_dt(spec)), len(step.table.differentiable)
    for given in (1, spec.order + 1):
        grads = _gradients(spec, 70, given)
        got = {name: L.adjoint(grads, dt, 70, (True,) * nd) for name, L in forms.items()}
        assert all(torch.equal(a, b) for a, b in zip(got["first"], got["late"]))
        tol = 1e-12 if spec.dtype == "float64" else 1e-5
        for actual, expected in zip(got["late"], _reference(spec, grads)):
            scale_close(actual.double().numpy(), expected, tol)


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.name)
def test_threads_and_batches_on_both_sides_of_the_threshold(spec):
    """The built kernels, every gradient given: a batch whose share with one thread is above the
    threshold (rows loaded first) and with two threads below it (each row where used), and a
    small batch; the same bits with 1 and 2 threads, and the reference's gradients."""
    per_share = render.LATE_LOADS_MAX_BYTES // _per_element_bytes(spec, spec.order + 1)
    big = per_share + per_share // 2  # one thread: above; two threads: each share below
    step = ts.load(spec)
    before = torch.get_num_threads()
    try:
        for B in (70, big):
            grads = _gradients(spec, B, spec.order + 1)
            runs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                u = torch.zeros(B, spec.n_actions, spec.dof, dtype=getattr(torch, spec.dtype), requires_grad=True)
                starts = [torch.zeros(B, spec.dof, dtype=u.dtype, requires_grad=True) for _ in range(4)]
                outs = step(u, *starts[:3], _dt(spec), j0=starts[3])
                runs.append(torch.autograd.grad(outs, [u, *starts], grads))
            assert all(torch.equal(a, b) for a, b in zip(*runs))
            tol = 1e-12 if spec.dtype == "float64" else 1e-5
            for actual, expected in zip(runs[0], _reference(spec, grads)):
                scale_close(actual.double().numpy(), expected, tol)
    finally:
        torch.set_num_threads(before)
