"""CUDA: generated sources compile to PTX everywhere (nvcc); kernels verified where a GPU exists."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import re
import shutil
import subprocess
import threading
import types

import numpy as np
import pytest
import torch

import reference
import reference_bspline
import tensorstep as ts
from cuda_on_host import HostCudaBackend, host_source, host_step
from tensorstep.codegen import abi, render, targets
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import lowered
from tensorstep.runtime import cbackend
from tensorstep.runtime.api import Step
from tensorstep.runtime.launch import CpuBackend, Launcher
from tensorstep.runtime.verify import verify_launcher
from helpers import (GRID, Inputs, ReferenceCase, as_bhd, check_dt_derivatives, dt_value, gradcheck64, gradgradcheck64,
                     grid_id, make_spec, to_bhd)
from helpers import D, H, scale_close
from sweep import sample

NVCC = shutil.which("nvcc")
HAS_GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401

    HAS_CUPY = True
except ImportError:
    HAS_CUPY = False

gpu = pytest.mark.skipif(not (HAS_GPU and HAS_CUPY), reason="needs an NVIDIA GPU and CuPy")
PTX_GRID = GRID + [dict(g, **{}) for g in GRID[:4]]


def _dt_of(spec, B: int, seed: int = 0) -> torch.Tensor:
    """A float64 dt of the spec's shape: a scalar, [H] per step, or [B] per trajectory."""
    n = {"uniform": 0, "per_step": spec.horizon, "per_trajectory": B}[spec.dt]
    if n == 0:
        return torch.tensor(0.07, dtype=torch.float64)
    return 0.05 + 0.1 * torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("dtype, coefficients", [("float32", "shared"), ("float64", "shared"),
                                                 ("float64", "global")])
def test_every_variant_compiles_to_ptx(tmp_path, dtype, coefficients, monkeypatch):
    """All variants of the grid, both dtypes, all kernels, in one translation unit per dtype;
    the step coefficients in shared memory (copied from the table, or computed by the block), and
    read from global memory or computed by each thread (tables too large to share)."""
    if coefficients == "global":
        monkeypatch.setattr(targets, "CUDA_SHARED_COEF_BYTES", 0)
    sources = [ts.source(make_spec(g, dtype=dtype), "cuda") for g in GRID]
    assert all(("__shared__ T coef" in src) == (coefficients == "shared") for src in sources)
    unit = tmp_path / f"grid_{dtype}.cu"
    # one unit: typedef and enum per spec are scoped by wrapping each source in a namespace
    unit.write_text("\n".join(f"namespace v{i} {{\n{src}\n}}" for i, src in enumerate(sources)).replace(
        'extern "C" ', ""))
    result = subprocess.run([NVCC, "-ptx", "-arch=sm_80", str(unit), "-o", str(tmp_path / "out.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    ptx = (tmp_path / "out.ptx").read_text()
    assert ptx.count(".entry") == 7 * len(GRID)  # and the table and jvp table kernels


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_standalone_source_compiles_with_extern_c_names(tmp_path):
    spec = make_spec(GRID[0], dtype="float32")
    unit = tmp_path / "one.cu"
    unit.write_text(ts.source(spec, "cuda"))
    result = subprocess.run([NVCC, "-ptx", "-arch=sm_80", str(unit), "-o", str(tmp_path / "one.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    ptx = (tmp_path / "one.ptx").read_text()
    assert f".entry {spec.name}_forward" in ptx  # unmangled, unique per spec


@gpu
@pytest.mark.parametrize("overrides", GRID, ids=[grid_id(g) for g in GRID])
def test_cuda_matches_reference_and_c(overrides):
    spec = make_spec(overrides)
    x = Inputs(spec, batch=5)
    dt = dt_value(spec)
    cpu = ts.load(spec, "cpu")(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    dev = torch.device("cuda")
    kw = {k: v.to(dev) for k, v in x.kwargs().items()}
    gpu_out = ts.load(spec, "cuda")(x.u.to(dev), x.p0.to(dev), x.v0.to(dev), x.a0.to(dev), dt.to(dev), **kw)
    expected = reference.apply(spec, dt.tolist(), x.numpy_u_bhd(), x.numpy_start())
    for k, (a, b) in enumerate(zip(cpu, gpu_out)):
        scale_close(to_bhd(b.cpu(), spec), expected[k], 1e-12)
        scale_close(b.cpu().numpy(), a.numpy(), 1e-12)


@gpu
@pytest.mark.parametrize("overrides", GRID[::3], ids=[grid_id(g) for g in GRID[::3]])
def test_cuda_gradcheck(overrides):
    spec = make_spec(overrides)
    step = ts.load(spec, "cuda")
    dev = torch.device("cuda")
    x = Inputs(spec, batch=2)
    args = [t.detach().to(dev).requires_grad_(True) for t in (x.u, x.p0, x.v0, x.a0, x.j0)]
    dt = dt_value(spec).to(dev).requires_grad_(True)
    kw = {"start_index": x.idx.to(dev)} if x.idx is not None else {}
    f = lambda u, p0, v0, a0, j0, dt: step(u, p0, v0, a0, dt, j0=j0, **kw)
    assert gradcheck64(f, (*args, dt), check_forward_ad=True)
    g = lambda u, p0, v0, a0, j0: step(u, p0, v0, a0, dt.detach(), j0=j0, **kw)
    assert gradgradcheck64(g, tuple(args), check_fwd_over_rev=True)


@gpu
def test_cuda_out_matches_reference():
    spec = make_spec(dict(control="acceleration", integrator="exact", start_index=True))
    x = Inputs(spec, batch=5)
    dev = torch.device("cuda")
    kw = {k: v.to(dev) for k, v in x.kwargs().items()}
    out = torch.full((4, 5, spec.horizon, spec.dof), float("nan"), dtype=torch.float64, device=dev).unbind(0)
    with torch.no_grad():
        ts.load(spec, "cuda")(x.u.to(dev), x.p0.to(dev), x.v0.to(dev), x.a0.to(dev), 0.1, out=out, **kw)
    expected = reference.apply(spec, [0.1], x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(out):
        scale_close(y.cpu().numpy(), expected[k], 1e-12)


@gpu
def test_cuda_large_batch_matches_cpu():
    """The largest batch that fits comfortably: exercises 64-bit indexing when B·H·D > 2^31."""
    spec = ts.KernelSpec(horizon=32, dof=7, dtype="float32")
    free, _ = torch.cuda.mem_get_info()
    per_batch = 4 * (31 * 7 + 4 * 32 * 7 + 3 * 7)
    B = int(min(free * 0.6 // per_batch, 2**31 // (32 * 7) + 4096))
    dev = torch.device("cuda")
    u = torch.randn(B, 31, 7, device=dev)
    z = torch.zeros(B, 7, device=dev)
    outs = ts.load(spec, "cuda")(u, z, z, z, 0.02)
    tail = slice(B - 3, B)
    ref = ts.load(spec, "cpu")(u[tail].cpu(), z[tail].cpu(), z[tail].cpu(), z[tail].cpu(), 0.02)
    for a, b in zip(outs, ref):
        assert torch.allclose(a[tail].cpu(), b, rtol=1e-5, atol=1e-3)


@gpu
def test_cuda_second_device_if_present():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    spec = ts.KernelSpec(horizon=8, dof=2, dtype="float64")
    dev = torch.device("cuda", 1)
    u = torch.randn(3, 7, 2, dtype=torch.float64, device=dev)
    z = torch.zeros(3, 2, dtype=torch.float64, device=dev)
    outs = ts.load(spec, dev)(u, z, z, z, 0.1)
    ref = ts.load(spec, "cpu")(u.cpu(), z.cpu(), z.cpu(), z.cpu(), 0.1)
    for a, b in zip(outs, ref):
        scale_close(a.cpu().numpy(), b.numpy(), 1e-12)


# Integrator adjoints this long (float64) roll into a reverse loop for CUDA (targets.CUDA_ROLL_ABOVE_BYTES):
# straight-line they would hold every row's gradients in registers and spill.
INTEGRATORS = [g for g in GRID if g.get("control", "position") != "position"]
LONG = 40


def _kernel_text(source: str, name: str) -> str:
    start = source.index(f"void {name}(")
    return source[start:source.index("\n}\n", start)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_long_integrator_adjoints_roll_and_compile(tmp_path):
    specs = [make_spec(g, horizon=LONG) for g in INTEGRATORS]
    sources = [ts.source(spec, "cuda") for spec in specs]
    for spec, src in zip(specs, sources):
        assert "; --r)" in _kernel_text(src, f"{spec.name}_adjoint"), spec.name  # the reverse scan
        assert "; --r)" not in _kernel_text(src, f"{spec.name}_forward"), spec.name
    short = make_spec(INTEGRATORS[0], dtype="float32", horizon=16)
    assert "; --r)" not in _kernel_text(ts.source(short, "cuda"), f"{short.name}_adjoint")
    unit = tmp_path / "rolled.cu"
    unit.write_text("\n".join(f"namespace v{i} {{\n{src}\n}}" for i, src in enumerate(sources)).replace(
        'extern "C" ', ""))
    result = subprocess.run([NVCC, "-ptx", "-arch=sm_80", str(unit), "-o", str(tmp_path / "rolled.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@gpu
@pytest.mark.parametrize("overrides", INTEGRATORS, ids=[grid_id(g) for g in INTEGRATORS])
def test_cuda_rolled_adjoint_matches_reference(overrides):
    spec = make_spec(overrides, horizon=LONG)
    dev = torch.device("cuda")
    x = Inputs(spec, batch=5)
    dt = dt_value(spec)
    u = x.u.detach().to(dev).requires_grad_(True)
    kw = {k: v.to(dev) for k, v in x.kwargs().items()}
    outs = ts.load(spec, "cuda")(u, x.p0.to(dev), x.v0.to(dev), x.a0.to(dev), dt.to(dev), **kw)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs]
    (gu,) = torch.autograd.grad(outs, [u], [g.to(dev) for g in grads])
    expect_u, _ = reference.apply_adjoint(spec, dt.tolist(), np.stack([to_bhd(g, spec) for g in grads]))
    scale_close(to_bhd(gu.cpu(), spec), expect_u, 1e-12)


# every variant straight and rolled; with every table in global memory (CUDA_SHARED_COEF_BYTES = 0), a seeded
# one of each of stencils and recurrences with a dt shared and per step (all 18 under TENSORSTEP_FULL_SWEEP=1):
# that form changes only where a kernel reads its coefficients (codegen/targets.py cuda_coefficients: "global"
# for every table), not the statements that read them; which table (monomials of one dt, a per-step program)
# follows from the kinds of control and dt
table_kind = lambda g: (g.get("control", "position") == "position", g.get("dt", "uniform"))
GLOBAL_TABLES = [g for seed, kind in enumerate(sorted({table_kind(g) for g in GRID}), start=20)
                 for g in sample([g for g in GRID if table_kind(g) == kind], 1, seed)]
HOST_FORMS = [(g, form) for g in GRID for form in ("straight", "rolled")] + [
    (g, "global-coefficients") for g in GLOBAL_TABLES]


@pytest.mark.parametrize("overrides, form", HOST_FORMS, ids=[f"{grid_id(g)}-{form}" for g, form in HOST_FORMS])
def test_cuda_source_run_on_the_host_matches_reference(overrides, form, monkeypatch):
    """The CUDA forward and adjoint, every thread of the grid run in turn on the host (no GPU
    needed): forward against the dense float64 operator, adjoint by the dot test."""
    if form == "rolled":
        if overrides.get("control", "position") == "position":
            pytest.skip("stencil adjoints are never rolled")
        monkeypatch.setattr(targets, "CUDA_ROLL_ABOVE_BYTES", 0)
    if form == "global-coefficients":
        monkeypatch.setattr(targets, "CUDA_SHARED_COEF_BYTES", 0)
    spec = make_spec(overrides)
    source, _ = host_source(spec)
    assert ("; --r)" in _kernel_text(source, f"{spec.name}_adjoint_thread")) == (form == "rolled")  # dt_vjp always rolls
    assert ("__shared__ T coef" in source) == (form != "global-coefficients")
    row = verify_launcher(spec, Launcher(spec, HostCudaBackend(spec)), torch.device("cpu"), B=150)  # 2 blocks
    assert row["forward"] <= 1e-12 and row["adjoint"] <= 1e-12, row


# wide per-step stencils of order 4, whose CUDA adjoint stores are accumulations in read order and
# whose tangent loads each input once (codegen/reads.py): the horizons of tests/cuda/test_ptxas.py
WIDE = [(dict(difference="backward", accuracy=3, dt="per_step", order=4), 32),
        (dict(difference="central", accuracy=8, dt="per_step", order=4), 64),
        (dict(difference="central", accuracy=4, dt="per_step", order=4), 32)]


# the backward stencil, and a seeded one of the two central (both under TENSORSTEP_FULL_SWEEP=1): the
# central ones run one path, their widths differing only in how many rows each store accumulates
WIDE_RUN = WIDE[:1] + sample(WIDE[1:], 1, seed=13)


@pytest.mark.parametrize("overrides, horizon", WIDE_RUN, ids=[grid_id(o) for o, _ in WIDE_RUN])
def test_wide_stencils_run_on_the_host_match_reference(overrides, horizon):
    """The CUDA kernels of wide stencils run on the host: forward against the dense float64
    operator and adjoint by the dot test at 1e-12, dt's gradient and tangent against differences
    of the reference in dt."""
    spec = make_spec(overrides, horizon=horizon, dof=2)
    row = verify_launcher(spec, Launcher(spec, HostCudaBackend(spec)), torch.device("cpu"), B=150)  # 2 blocks
    assert row["forward"] <= 1e-12 and row["adjoint"] <= 1e-12, row
    check_dt_derivatives(ReferenceCase(spec, B=3, seed=4), [("cuda-on-host", host_step(spec))])


# B-splines with 2 rows a span: the adjoint's stores on either side of its knots' loop each load the
# output gradients they read (codegen/reads.py ``in_read_order``), a dt per trajectory and uniform
TWO_ROWS_A_SPAN = [dict(control="bspline", degree=4, knots=12, steps=2, dt="per_trajectory"),
                   dict(control="bspline", degree=5, knots=16, steps=2, dt="per_trajectory"),
                   dict(control="bspline", degree=5, knots=20, steps=2)]


# a seeded one of the two with a dt per trajectory (both under TENSORSTEP_FULL_SWEEP=1), and the uniform
# one: the two run one path, their degree and knots differing only in the loop's trip count and width
@pytest.mark.parametrize("overrides", sample(TWO_ROWS_A_SPAN[:2], 1, seed=12) + TWO_ROWS_A_SPAN[2:], ids=grid_id)
def test_b_splines_of_two_rows_a_span_run_on_the_host_match_reference(overrides):
    """Their CUDA kernels run on the host: forward against the dense float64 operator and adjoint by
    the dot test at 1e-12, dt's gradient and tangent against differences of the reference in dt."""
    spec = ts.KernelSpec(dof=2, dtype="float64", **overrides)
    row = verify_launcher(spec, Launcher(spec, HostCudaBackend(spec)), torch.device("cpu"), B=150)  # 2 blocks
    assert row["forward"] <= 1e-12 and row["adjoint"] <= 1e-12, row
    check_dt_derivatives(ReferenceCase(spec, B=3, seed=4), [("cuda-on-host", host_step(spec))])


def test_float32_b_spline_forward_reads_its_straight_line_coefficients_where_used_and_matches_reference():
    """float32, uniform dt, 2 rows a span: the forward's straight-line spans read each coefficient
    through the volatile pointer (codegen/targets.py cuda_volatile_coefficients; in registers, degree 5
    with 32 knots spilled 24 bytes), the adjoint's through the table; run on the host, the forward
    against the dense float64 operator and the adjoint by the dot test at 1e-5."""
    spec = ts.KernelSpec(control="bspline", degree=5, knots=20, steps=2, dof=2, dtype="float32")
    source = ts.source(spec, "cuda")
    assert "volatile const T* const ts_coef" in _kernel_text(source, f"{spec.name}_forward")
    assert "volatile const T* const ts_coef" not in _kernel_text(source, f"{spec.name}_adjoint")
    row = verify_launcher(spec, Launcher(spec, HostCudaBackend(spec)), torch.device("cpu"), B=150)  # 2 blocks
    assert row["forward"] <= 1e-5 and row["adjoint"] <= 1e-5, row


# a dt per trajectory: each thread computes its coefficients, monomials of its dt (no table); the
# adjoint, dt_jvp and dt_vjp read each monomial's factor from the block's copy in shared memory
# (float64; float32: dt_vjp), dt_jvp its coefficients' powers from the thread's column of them there
# too (codegen/targets.py cuda_volatile_coefficients, cuda_shared_powers); float32's adjoint and
# dt_jvp: tests/cuda/test_float_products.py
THREAD_COEFFICIENTS = [dict(control="bspline", degree=5, knots=7, steps=3, order=4),
                       dict(control="bspline", degree=4, knots=6, steps=2),
                       dict(difference="central", horizon=9), dict(control="jerk", integrator="exact", horizon=9)]
#: what a copied factor is scaled by where a test checks that a kernel reads the copy
SCALED = 1.0000001


def _thread_coefficients_spec(overrides: dict) -> ts.KernelSpec:
    fields = dict(overrides, dt="per_trajectory")
    if fields.get("control") == "bspline":  # the horizon follows from knots and steps
        return ts.KernelSpec(dof=2, dtype="float64", **fields)
    return make_spec(fields, horizon=fields.pop("horizon"), dof=2)


def _check_thread_coefficients(spec, kernels: tuple[str, ...], B: int = 3) -> None:
    """Forward and adjoint (dot test) against the dense float64 operator at 1e-12, where
    ``kernels`` has the adjoint, and dt's gradient and tangent against differences of the reference
    in dt, where it has dt_vjp or dt_jvp."""
    if "adjoint" in kernels:
        row = verify_launcher(spec, Launcher(spec, HostCudaBackend(spec)), torch.device("cpu"), B=B)
        assert row["forward"] <= 1e-12 and row["adjoint"] <= 1e-12, row
    if {"dt_vjp", "dt_jvp"} & set(kernels):
        check_dt_derivatives(ReferenceCase(spec, B=3, seed=4), [("cuda-on-host", host_step(spec))])


# a seeded one of the two B-splines (their kernels copy the factors by the one generic rule at any degree and
# order), the stencil and the recurrence
@pytest.mark.parametrize("overrides", sample(THREAD_COEFFICIENTS[:2], 1, seed=9) + THREAD_COEFFICIENTS[2:], ids=grid_id)
def test_coefficients_of_a_dt_per_trajectory_from_copied_factors_run_on_the_host_match_reference(overrides,
                                                                                                   monkeypatch):
    """The CUDA kernels of a dt per trajectory run on the host, their factors read from the block's
    copy: forward and adjoint against the dense operator, dt's gradient and tangent against
    differences of the reference (``_check_thread_coefficients``). With one kernel's copy of the
    factors scaled by ``SCALED`` (1e-7 more), the check of that kernel fails."""
    import cuda_on_host

    spec = _thread_coefficients_spec(overrides)
    source, _ = host_source(spec)
    copy = f"ts_mono_c[i] = {spec.name}_mono_c[i];"
    for kernel in ("adjoint", "dt_vjp", "dt_jvp"):
        assert copy in _kernel_text(source, f"{spec.name}_{kernel}_thread"), kernel
    _check_thread_coefficients(spec, ("adjoint", "dt_vjp", "dt_jvp"), B=150)  # 300 columns: two blocks
    for kernel in ("adjoint", "dt_vjp", "dt_jvp"):
        def scaled(spec, kernel=kernel):
            text, declarations = host_source(spec)
            start = text.index(f"void {spec.name}_{kernel}_thread(")
            at = text.index(copy, start)
            return text[:at] + copy.replace("[i];", f"[i] * {SCALED!r};") + text[at + len(copy):], declarations

        monkeypatch.setattr(cuda_on_host, "host_source", scaled)
        with pytest.raises(AssertionError):
            _check_thread_coefficients(spec, (kernel,))


BLOCK_TABLES = [dict(control="acceleration", dt="per_step"), dict(control="jerk", integrator="exact", dt="per_step", order=4),
                dict(control="velocity"), dict(difference="central", accuracy=(2, 4, 2))]


@pytest.mark.parametrize("overrides", BLOCK_TABLES, ids=[grid_id(g) for g in BLOCK_TABLES])
def test_a_blocks_own_table_is_the_table_kernels_to_the_last_bit(overrides, monkeypatch):
    """Where each block of a per-element kernel computes its coefficients in shared memory (an
    integrator's per-step rows, monomials of a uniform dt: no table kernel, no launch), the
    forward, the adjoint, dt_vjp and dt_jvp give what they give with tables too large to share
    (the table kernel's table, read from global memory), bit for bit: the same values, rounded the same way (float32; compiled
    without fused multiply-adds, which a compiler may choose differently for either source)."""
    spec = make_spec(overrides, dtype="float32", horizon=12, dof=3)
    B = 70  # 210 columns: 7 blocks of 32, the last one partial
    x = Inputs(spec, B, seed=4)
    gen = torch.Generator().manual_seed(5)
    inputs = [getattr(x, a.c_name) for a in table(spec).tensors]
    dt = (0.05 + 0.1 * torch.rand(spec.n_dt, generator=gen)).to(torch.float32)
    ddt = torch.rand(spec.n_dt, generator=gen).to(torch.float32)
    tangents = [None if getattr(x, a.c_name) is None else torch.randn(getattr(x, a.c_name).shape, generator=gen)
                for a in table(spec).differentiable]
    runs, launched = [], []
    try:
        with monkeypatch.context() as m:  # the host compiler fusing no multiply-add: the source's arithmetic
            m.setenv("TENSORSTEP_CFLAGS", "-ffp-contract=off")
            cbackend.c_flags.cache_clear()
            for limit in (targets.CUDA_SHARED_COEF_BYTES, 0):
                m.setattr(targets, "CUDA_SHARED_COEF_BYTES", limit)
                backend = HostCudaBackend(spec)
                launcher = Launcher(spec, backend)
                ys = launcher.forward(inputs, dt)
                grads = [torch.randn(y.shape, generator=torch.Generator().manual_seed(6 + k)) for k, y in enumerate(ys)]
                gs = launcher.adjoint(grads, dt, B, [True] * len(table(spec).differentiable))
                runs.append([*ys, *[g for g in gs if g is not None], launcher.dt_vjp(inputs, grads, dt),
                             *launcher.dt_jvp(inputs, tangents, dt, ddt)])
                launched.append({kernel for kernel, _, _ in backend.launched})
    finally:
        cbackend.c_flags.cache_clear()
    assert not launched[0] & {"coefficients", "coefficients_jvp"}
    assert launched[1] >= {"coefficients", "coefficients_jvp"}
    assert len(runs[0]) == len(runs[1]) and all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("overrides", GRID, ids=[grid_id(g) for g in GRID])
def test_cuda_source_run_on_the_host_passes_gradcheck(overrides):
    """All five CUDA kernels run on the host behind the Python autograd path: gradients to every
    input and to dt (adjoint, dt_vjp, dt_vjp_finish) and forward mode (dt_jvp) against finite
    differences of the forward kernel."""
    spec = make_spec(overrides)
    step = host_step(spec)
    x = Inputs(spec, batch=2)
    args = [t.detach().requires_grad_(True) for t in (x.u, x.p0, x.v0, x.a0, x.j0)]
    dt = dt_value(spec).requires_grad_(True)
    kw = {"start_index": x.idx} if x.idx is not None else {}
    f = lambda u, p0, v0, a0, j0, dt: step(u, p0, v0, a0, dt, j0=j0, **kw)
    assert gradcheck64(f, (*args, dt), check_forward_ad=True)


# The CUDA source run on the host against the independent references (tests/reference.py,
# tests/reference_bspline.py) with start and goal tables picked by start_index and goal_index:
# until a GPU has run these kernels, this is the evidence for the CUDA gathers and scatters.
INDEXED = [
    dict(difference="central", start_index=True, layout="bdh"),
    dict(difference="backward", accuracy=2, order=4, start_index=True),
    dict(control="acceleration", integrator="exact", start_index=True),
    dict(control="jerk", integrator="exact", dt="per_step", start_index=True, layout="bdh"),
    dict(control="velocity", dt="per_trajectory", start_index=True),
    dict(end="goal", goal_index=True, start_index=True, layout="bdh"),
    dict(end="goal", goal_index=True, accuracy=(2, 4, 2), dt="per_step"),
    dict(end="goal", goal_index=True, start_index=True, dt="per_trajectory"),
    dict(control="bspline", degree=3, knots=5, steps=3, start_index=True),
    dict(control="bspline", degree=4, knots=3, steps=2, end="goal", goal_index=True, start_index=True,
         dt="per_trajectory", layout="bdh"),
    # layout "bdh" above a warp's whole rows (float64 H > 32 at order 3, H > 25 at order 4): row tiles
    dict(difference="central", start_index=True, layout="bdh", horizon=40),
    dict(end="goal", goal_index=True, start_index=True, layout="bdh", dt="per_step", order=4, horizon=37),
    dict(control="jerk", integrator="exact", dt="per_trajectory", start_index=True, layout="bdh", horizon=45),
    dict(control="bspline", degree=4, knots=5, steps=8, end="goal", goal_index=True, start_index=True, layout="bdh"),
]


def _indexed_spec(overrides: dict) -> ts.KernelSpec:
    if overrides.get("control") == "bspline":  # the horizon follows from knots and steps
        return ts.KernelSpec(dof=2, dtype="float64", **overrides)
    fields = dict(overrides)
    return make_spec(fields, horizon=fields.pop("horizon", H))


def _reference_jacobians(case: ReferenceCase) -> list[tuple]:
    """Per trajectory, the reference's dense operator (of u [K, H, N], of the start state [K, H, 4],
    of the goal state [K, H, 4] or None), K = P..J (and S, not for a B-spline), by probing it."""
    spec = case.spec

    def one(dt) -> tuple:
        if spec.control == "bspline":  # a uniform or per-trajectory dt: one number
            zero = [np.zeros(1)] * 4
            t = reference_bspline.trajectory(np.zeros((spec.n_actions, 1)), zero, zero if case.goal else None,
                                             spec.degree, spec.steps, float(np.ravel(dt)[0]))
            return t.jac_knots, t.jac_start, t.jac_goal
        return (*reference.matrices(spec, dt), reference.goal_matrix(spec, dt) if case.goal else None)

    if spec.dt == "per_trajectory":
        return [one(case.dt[b].item()) for b in range(case.B)]
    return [one(case.dt.reshape(-1).tolist())] * case.B


@pytest.mark.parametrize("overrides", INDEXED, ids=grid_id)
def test_cuda_source_run_on_the_host_with_indices_matches_reference(overrides):
    """Start and goal rows picked from tables (B + 2, B + 1 rows, some picked twice), dt uniform,
    per step or per trajectory, B·D = 260 columns (two blocks): the outputs against the
    reference's dense operator applied to the picked rows, and the gradient of every input (the
    tables' scatter-added through the indices) against that operator's transpose, at 1e-12."""
    spec = _indexed_spec(overrides)
    case = ReferenceCase(spec, B=130, seed=2)
    assert case.idx is not None or case.gidx is not None
    jacobians = _reference_jacobians(case)
    K = jacobians[0][0].shape[0]
    u = as_bhd(case.u, spec)
    start = torch.stack(case.start, 1).numpy()  # [S, 4, D]
    goal = torch.stack(case.goal, 1).numpy() if case.goal else None
    srow = case.idx.numpy() if case.idx is not None else np.arange(case.B)
    grow = case.gidx.numpy() if case.gidx is not None else np.arange(case.B)
    expect = np.zeros((K, case.B, spec.horizon, spec.dof))
    for b, (J_u, J_s, J_g) in enumerate(jacobians):
        expect[:, b] = J_u @ u[b] + J_s @ start[srow[b]]
        if goal is not None:
            expect[:, b] += J_g @ goal[grow[b]]

    xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    ys = case.call(host_step(spec), *xs, case.dt)[:K]
    for y, e in zip(ys, expect):
        scale_close(as_bhd(y, spec), e, 1e-12)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ys]
    got = [g.numpy() for g in torch.autograd.grad(ys, xs, weights)]
    W = np.stack([as_bhd(w, spec) for w in weights])  # [K, B, H, D]
    expect_u = np.zeros_like(u)
    expect_start = np.zeros((start.shape[1], *start[:, 0].shape))  # [4, S, D]
    expect_goal = None if goal is None else np.zeros((goal.shape[1], *goal[:, 0].shape))
    for b, (J_u, J_s, J_g) in enumerate(jacobians):
        expect_u[b] = np.einsum("khn,khd->nd", J_u, W[:, b])
        expect_start[:, srow[b]] += np.einsum("khm,khd->md", J_s, W[:, b])
        if goal is not None:
            expect_goal[:, grow[b]] += np.einsum("khm,khd->md", J_g, W[:, b])
    scale_close(got[0], expect_u if spec.layout == "bhd" else expect_u.transpose(0, 2, 1), 1e-12)
    for m in range(4):
        scale_close(got[1 + m], expect_start[m], 1e-12)
        if goal is not None:
            scale_close(got[5 + m], expect_goal[m], 1e-12)


@pytest.mark.parametrize("overrides", INDEXED, ids=grid_id)
def test_cuda_source_run_on_the_host_with_indices_dt_derivatives_match_reference(overrides):
    """dt's gradient (dt_vjp, dt_vjp_finish) and tangent (dt_jvp) of the CUDA kernels run on the host,
    start and goal rows picked by their indices, against differences of the reference in dt
    (helpers.check_dt_derivatives)."""
    spec = _indexed_spec(overrides)
    check_dt_derivatives(ReferenceCase(spec, B=3, seed=4), [("cuda-on-host", host_step(spec))])



def test_no_cuda_kernel_uses_atomics():
    """The dt gradient is summed in a fixed order (per-block rows, then the blocks in turn): no
    atomic operation is left whose order the scheduler would pick (bitwise-reproducible gradients)."""
    for g in GRID + [dict(dt="per_trajectory"), dict(dt="per_trajectory", control="jerk")]:
        for dtype in ("float32", "float64"):
            assert "atomic" not in ts.source(make_spec(g, dtype=dtype), "cuda")


# each dt mode once: a seeded one of the two with a dt per step (a stencil's, an integrator's: their blocks'
# partial sums are added by the same dt_vjp_finish), a uniform dt and a dt per trajectory
@pytest.mark.parametrize("overrides", sample([GRID[1], GRID[17]], 1, seed=10)
                         + [GRID[14], dict(dt="per_trajectory", control="jerk")], ids=grid_id)
def test_cuda_dt_gradient_over_several_blocks_on_the_host(overrides):
    """B·D = 600 columns, three blocks of partial sums (per trajectory: one per column): the dt
    gradient of the CUDA kernels run on the host passes gradcheck (finite differences of the
    forward) and is bitwise the same twice."""
    spec = make_spec(overrides)
    step = host_step(spec)
    x = Inputs(spec, batch=300)
    assert 300 * spec.dof >= 600
    dt = _dt_of(spec, 300).requires_grad_(True)
    f = lambda dt: step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    assert gradcheck64(f, (dt,))
    weights = [torch.randn(y.shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
               for k, y in enumerate(f(dt))]
    first, again = (torch.autograd.grad(f(dt), dt, weights)[0] for _ in range(2))
    assert torch.equal(first, again)

# CUDA graph capture: nothing may be allocated, compiled or loaded while a stream is captured.
# Without a GPU the capture is simulated by patching torch's predicate; the real capture is below.


@pytest.fixture
def capture(monkeypatch):
    """A switch for a simulated CUDA graph capture on the current stream."""
    state = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["on"])
    return state


def test_capture_refuses_a_new_float_dt_and_prepare_caches_it(capture):
    spec = make_spec(GRID[0])
    step = Step(spec, torch.device("cpu"), Launcher(spec, CpuBackend(spec)))
    step.native = None  # the Python path, as on CUDA
    x = Inputs(spec, batch=3)
    args, kw = (x.u, x.p0, x.v0, x.a0), x.kwargs()
    expected = step(*args, 0.25, **kw)
    capture["on"] = True
    with pytest.raises(RuntimeError, match=r"dt=0\.07 .*CUDA graph capture.*step\.prepare"):
        step(*args, 0.07, **kw)
    assert 0.07 not in step._dt_cache  # nothing was created for it
    assert all(torch.equal(a, b) for a, b in zip(step(*args, 0.25, **kw), expected))  # a cached dt is fine
    assert len(step(*args, torch.tensor(0.07, dtype=torch.float64), **kw)) == 4  # so is a tensor dt
    with pytest.raises(RuntimeError, match="prepare was called"):
        step.prepare(dt=0.07)
    capture["on"] = False
    assert step.prepare(dt=0.07) is step
    cached = step._dt_cache[0.07]
    capture["on"] = True
    outs = step(*args, 0.07, **kw)
    assert step._dt_cache[0.07] is cached
    expect = reference.apply(spec, [0.07], x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(outs):
        scale_close(to_bhd(y, spec), expect[k], 1e-12)


class FakeCupy:
    """Just enough of CuPy for CudaBackend: records module builds and launches, by either path (a
    RawKernel's call, or the driver's launchKernel with a function handle, each parameter read
    back as the kernel's C signature declares it), each launch as (symbol, grid, block, shared
    memory bytes) in ``shapes`` and with its stream and arguments in ``calls``."""

    def __init__(self, table_=None, name=""):
        self.built: list[str] = []
        self.launched: list[str] = []
        self.shapes: list[tuple] = []  # (symbol, grid, block, shared memory bytes)
        self.calls: list[tuple] = []  # (symbol, grid, block, shared, stream, arguments)
        self.device = 0  # the current device
        self.devices: list[int] = []  # each device entered
        self.contexts = 0  # runtime calls that make a context current
        self.current_stream = [None]  # CuPy's stream context
        handles: dict[int, str] = {}
        fake = self
        signatures = {}  # each entry point's C signature, read now (a test may count the ABI's calls)
        for kernel in ("forward", "adjoint", "dt_vjp", "dt_vjp_finish", "dt_jvp", "coefficients", "coefficients_jvp",
                       "cost_sum"):
            with contextlib.suppress(ValueError, KeyError):
                signatures[kernel] = abi.cuda_arguments(kernel, table_) if table_ is not None else None

        def record(symbol, grid, block, shared, stream, args):
            fake.launched.append(symbol)
            fake.shapes.append((symbol, grid, block, shared))
            fake.calls.append((symbol, grid, block, shared, stream, tuple(args)))

        class Kernel:
            def __init__(self, symbol):
                self.symbol = symbol
                self.kernel = types.SimpleNamespace(ptr=1000 + len(handles))
                handles[self.kernel.ptr] = symbol

            def __call__(self, grid, block, args, shared_mem=0):
                record(self.symbol, grid, block, shared_mem, fake.current_stream[-1], args)

        class Module:
            def __init__(self, code, options):
                fake.built.append(code)

            def get_function(self, symbol):
                return Kernel(symbol)

        @contextlib.contextmanager
        def device(index):
            fake.devices.append(index)
            before, fake.device = fake.device, index
            yield
            fake.device = before

        class Stream:
            def __init__(self, ptr, index):
                self.ptr = ptr

            def __enter__(self):
                fake.current_stream.append(self.ptr)

            def __exit__(self, *exc):
                fake.current_stream.pop()

        def launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            symbol = handles[f]
            assert (gy, gz, by, bz, extra) == (1, 1, 1, 1, 0)
            kernel = symbol[len(name) + 1:]
            declared = signatures[kernel]
            pointers = (ctypes.c_void_p * len(declared)).from_address(params)
            args = [(ctypes.c_int64 if t == "int64_t" else ctypes.c_void_p).from_address(at).value or 0
                    for (t, _), at in zip(declared, pointers)]
            record(symbol, (gx,), (bx,), shared, stream, args)

        def mem_get_info():
            fake.contexts += 1

        self.RawModule = Module
        self.cuda = type("cuda", (), {
            "Device": staticmethod(device), "ExternalStream": Stream,
            "driver": types.SimpleNamespace(launchKernel=launch_kernel),
            "runtime": types.SimpleNamespace(getDevice=lambda: fake.device, memGetInfo=mem_get_info)})


def fake_cuda_backend(spec, monkeypatch, cupy=FakeCupy):
    """A CudaBackend built by its own __init__ on a FakeCupy (no GPU: buffers in host memory)."""
    from tensorstep.runtime import cuda_backend

    # PyTorch's current stream as both launch paths read it (with a CUDA build of PyTorch the raw
    # accessor exists and would give the real stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(cuda_backend, "raw_stream_reader", lambda: lambda index: 7)
    monkeypatch.setattr(cuda_backend, "_cupy", lambda: cupy(table(spec), spec.name))
    with monkeypatch.context() as m:  # CUDA is there while it is built, and no capture is under way
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        backend = cuda_backend.CudaBackend(spec, torch.device("cuda", 0))
    backend.empty = lambda size, dtype: torch.empty(size, dtype=dtype)  # no GPU memory here
    return backend


def test_capture_never_builds_or_loads_a_cuda_module(capture, monkeypatch):
    spec = make_spec(GRID[0])
    backend = fake_cuda_backend(spec, monkeypatch)
    assert len(backend.cupy.built) == 1
    capture["on"] = True
    args = lambda kernel: [0] * (len(abi.arguments(kernel, table(spec))) - 1)  # null pointers after B
    backend.call("forward", 2, args("forward"))  # loaded kernels launch inside a capture
    with pytest.raises(RuntimeError, match=r"dt gradient kernels \(dt_vjp\) would be compiled and loaded.*CUDA graph capture"):
        backend.call("dt_vjp", 2, args("dt_vjp"))
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        Launcher(spec, backend).prepare(dt_grad=True)
    assert len(backend.cupy.built) == 1
    capture["on"] = False
    Launcher(spec, backend).prepare(dt_grad=True)
    assert len(backend.cupy.built) == 3  # the dt gradient's module and the dt tangent's
    Launcher(spec, backend).prepare(dt_grad=True)  # once only
    capture["on"] = True
    backend.call("dt_vjp", 2, args("dt_vjp"))
    backend.call("dt_vjp_finish", 2, args("dt_vjp_finish"))
    assert len(backend.cupy.built) == 3
    # a uniform dt's monomials: each block computes its coefficients (no table kernel)
    assert backend.cupy.launched == [f"{spec.name}_{k}" for k in ("forward", "dt_vjp", "dt_vjp_finish")]



def test_a_slow_cuda_build_says_what_it_is_doing_and_a_fused_b_spline_one_why(monkeypatch, capfd):
    """A module whose build takes a while says what is compiled; a fused B-spline step's core module
    with fewer than degree + 4 knots (straight-line columns), past LONG_FUSED_BUILD_S, why it may take
    minutes. A fused recurrence's and a B-spline's with more knots (their columns loops over the
    steps, knot spans) and a plain step's say only what is compiled. A quick build
    (CuPy's disk cache) says nothing. The fake NVRTC takes 0.3 s a module, the thresholds are 0 (then
    defaults)."""
    import time

    from tensorstep.runtime import cache, cuda_backend

    class SlowCupy(FakeCupy):
        def __init__(self, *args):
            super().__init__(*args)
            module = self.RawModule
            self.RawModule = lambda code, options: time.sleep(0.3) or module(code, options)

    bspline = ts.KernelSpec(control="bspline", degree=3, knots=5, steps=3, dof=D, costs=FUSED["costs"],
                            outputs=FUSED["outputs"])
    with monkeypatch.context() as m:
        m.setattr(cache, "SLOW_BUILD_S", 0.0)
        m.setattr(cache, "WAIT_GAP_S", 0.0)  # each build a wait of its own, with its own notice
        m.setattr(cuda_backend, "LONG_FUSED_BUILD_S", 0.0)
        fake_cuda_backend(bspline, monkeypatch, cupy=SlowCupy)
        err = capfd.readouterr().err
        assert f"tensorstep: compiling {bspline.name} (CUDA core kernels with NVRTC, H={bspline.horizon})..." in err
        assert f"tensorstep: still compiling {bspline.name}: a fused B-spline step's CUDA forward and adjoint" in err
        assert f"(H={bspline.horizon}, {bspline.dtype})" in err
        rolled = bspline.replace(knots=7, horizon=None)
        for spec in (make_spec(FUSED), make_spec(GRID[0]), rolled):
            fake_cuda_backend(spec, monkeypatch, cupy=SlowCupy)
            err = capfd.readouterr().err
            assert f"tensorstep: compiling {spec.name} (CUDA core kernels" in err and "still compiling" not in err
    fake_cuda_backend(bspline, monkeypatch)  # at once, default thresholds
    time.sleep(0.05)
    assert "tensorstep:" not in capfd.readouterr().err


@pytest.mark.parametrize("has_from_external", [True, False], ids=["cupy14", "older"])
def test_pytorchs_stream_reaches_cupy_through_the_api_it_offers(has_from_external):
    """CuPy 14 deprecates ExternalStream for Stream.from_external(an object with __cuda_stream__);
    older CuPy has only ExternalStream. Either way CuPy gets PyTorch's raw stream handle."""
    from tensorstep.runtime.cuda_backend import external_stream

    seen = []

    class Stream:
        @staticmethod
        def from_external(obj):
            seen.append(("from_external", obj.__cuda_stream__()))
            return "wrapped"

    cuda = {"Device": staticmethod(lambda index: contextlib.nullcontext()),
            "ExternalStream": staticmethod(lambda ptr, index: seen.append(("ExternalStream", ptr, index)) or "old")}
    if has_from_external:
        cuda["Stream"] = Stream
    cupy = types.SimpleNamespace(cuda=type("cuda", (), cuda))
    got = external_stream(cupy, 0x1234, 1)
    if has_from_external:
        assert (got, seen) == ("wrapped", [("from_external", (0, 0x1234))])
    else:
        assert (got, seen) == ("old", [("ExternalStream", 0x1234, 1)])


class SmallBlocks(targets.CudaLaunchPlan):
    """A launch plan with 64-thread blocks, where the generated one has 256."""

    def block(self, B):
        return 64


def small_blocks(plan):
    return SmallBlocks(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init})


def test_cuda_backend_launches_what_the_plan_says(monkeypatch):
    """CudaBackend launches each kernel with its plan's grid, block and shared memory: the build's
    plan (a grid over the B·D columns, of 256 threads a block where that gives at least 132
    blocks, else smaller blocks down to a warp; a per-step table's kernel a grid of one block of
    256), and a plan with other blocks just as it says."""
    spec = make_spec(GRID[1])
    backend = fake_cuda_backend(spec, monkeypatch)
    D = spec.dof
    args = [0] * (len(abi.arguments("forward", table(spec))) - 1)
    name = spec.name
    for B, block in ((20000, 256), (9000, 128), (300, 32)):  # 157 blocks of 256; 141 of 128; 19 of 32
        backend.cupy.shapes.clear()
        backend.call("forward", B, args)
        assert backend.cupy.shapes == [(f"{name}_coefficients", (1,), (256,), 0),
                                       (f"{name}_forward", (-(-B * D // block),), (block,), 0)]
    backend.plan = small_blocks(backend.plan)
    backend.cupy.shapes.clear()
    backend.call("forward", B, args)
    assert backend.cupy.shapes == [(f"{name}_coefficients", (1,), (256,), 0),
                                   (f"{name}_forward", (-(-B * D // 64),), (64,), 0)]


def test_cuda_backend_works_out_each_launch_once(monkeypatch):
    """Per-call work is done once: the backend builds its plan once (not again for each library it
    loads), the plan names an entry point's arguments once per kernel, and calls with the same B
    get the very same launches, while another B gets its own grid; the plan keeps the latest
    CUDA_LAUNCHES_KEPT batch sizes."""
    spec = make_spec(GRID[0])
    plans, named = [], []
    launch_plan, arguments = targets.CudaTarget.launch_plan, abi.arguments
    monkeypatch.setattr(targets.CudaTarget, "launch_plan", lambda self, *a: plans.append(a) or launch_plan(self, *a))
    backend = fake_cuda_backend(spec, monkeypatch)
    Launcher(spec, backend).prepare(dt_grad=True)
    assert len(backend.cupy.built) == 3 and len(plans) == 1  # three libraries, one plan
    monkeypatch.setattr(abi, "arguments", lambda kernel, t: named.append(kernel) or arguments(kernel, t))
    args = [0] * (len(arguments("forward", table(spec))) - 1)
    D, plan = spec.dof, backend.plan
    for B in (20000, 20000, 300, 20000, 300):
        backend.cupy.shapes.clear()
        backend.call("forward", B, args)
        block = 256 if B == 20000 else 32
        assert backend.cupy.shapes[-1] == (f"{spec.name}_forward", (-(-B * D // block),), (block,), 0)
    assert named == ["forward"]
    first, small = plan.launches("forward", 20000), plan.launches("forward", 300)
    assert plan.launches("forward", 20000) is first and plan.launches("forward", 300) is small
    for B in range(1, targets.CUDA_LAUNCHES_KEPT + 1):  # 300 among them, 20000 not
        plan.launches("forward", B)
    again = plan.launches("forward", 20000)
    assert again is not first and again == first  # dropped, then worked out the same again
    assert named == ["forward"]


FUSED = dict(control="acceleration", dt="per_step", costs=(("bound", "position"), ("squared", "velocity")),
             outputs=("P",))


@pytest.mark.parametrize("overrides", [GRID[0], dict(control="acceleration", dt="per_step"),
                                       dict(control="jerk", dt="per_trajectory"), FUSED], ids=grid_id)
def test_direct_launches_pass_what_cupys_call_passes(overrides, monkeypatch):
    """Each entry point's launches through the driver (parameters packed once per (kernel, B),
    read back by the fake driver as each kernel's C signature declares them) are CuPy's call's:
    the same kernels, grids, blocks, shared memory, stream and argument values, in order, for
    several batch sizes and for a batch size seen again."""
    spec = make_spec(overrides)
    backend = fake_cuda_backend(spec, monkeypatch)
    Launcher(spec, backend).prepare(dt_grad=not spec.costs)  # every library loaded
    assert backend.direct
    pool, counts = {}, {}

    def empty(size, dtype):  # the same buffers on every call: the addresses compared are the same
        n = counts[(size, dtype)] = counts.get((size, dtype), -1) + 1
        return pool.setdefault((size, dtype, n), torch.empty(size, dtype=dtype))

    backend.empty = empty
    kernels = [k for k in abi.part_kernels("all", table(spec))]
    for B in (1, 300, 20000, 300):
        for kernel in kernels:
            args = [0x10000 * (i + 1) + B for i in range(len(abi.arguments(kernel, table(spec))) - 1)]
            got = {}
            for direct in (True, False):
                backend.direct = direct
                counts.clear()
                backend.cupy.calls.clear()
                backend.call(kernel, B, args)
                got[direct] = list(backend.cupy.calls)
            assert got[True] == got[False]
            assert got[True] and all(call[4] == 7 and call[5][0] == B for call in got[True])
    with pytest.raises(ValueError, match="expected .* arguments"):
        backend.direct = True
        backend.call("forward", 3, [0])


def test_direct_launches_read_the_stream_once_and_switch_devices_only_when_needed(monkeypatch):
    """A call reads PyTorch's current stream once; it enters CuPy's device context only when the
    current device is another (and leaves it as it was); the device's context is made current once
    per thread (a runtime call, as CuPy's launches do), except on the thread that loaded the
    kernels (where loading them did)."""
    spec = make_spec(GRID[0])
    backend = fake_cuda_backend(spec, monkeypatch)
    fake = backend.cupy
    reads = []
    backend._raw_stream = lambda index: reads.append(index) or 7
    args = [0] * (len(abi.arguments("forward", table(spec))) - 1)
    fake.devices.clear()
    backend.call("forward", 300, args)
    backend.call("forward", 300, args)
    assert (fake.devices, reads, fake.contexts) == ([], [0, 0], 0)
    fake.device = 1
    backend.call("forward", 300, args)
    assert (fake.devices, fake.device, fake.contexts) == ([0], 1, 0)
    fake.device = 0
    for _ in range(2):
        thread = threading.Thread(target=lambda: [backend.call("forward", 300, args) for _ in range(2)])
        thread.start()
        thread.join()
    assert fake.contexts == 2
    assert len(fake.calls) == 7 and all(call[4] == 7 for call in fake.calls)


class CupyWithoutLaunchKernel(FakeCupy):
    def __init__(self, *args):
        super().__init__(*args)
        self.cuda.driver = types.SimpleNamespace()


class CupyWithoutHandles(FakeCupy):
    def __init__(self, *args):
        super().__init__(*args)
        module = self.RawModule

        class Module(module):
            def get_function(self, symbol):
                kernel = module.get_function(self, symbol)
                del kernel.kernel
                return kernel

        self.RawModule = Module


@pytest.mark.parametrize("cupy, why", [(CupyWithoutLaunchKernel, "launchKernel"), (CupyWithoutHandles, "kernel.ptr"),
                                       (FakeCupy, None)], ids=["no-launchKernel", "no-handles", "switch"])
def test_without_direct_launches_cupys_call_launches_and_says_so(cupy, why, monkeypatch):
    """A CuPy without the driver's launchKernel or RawKernel function handles (a warning says
    which), or TENSORSTEP_CUDA_LAUNCH=cupy (no warning): launches through CuPy's RawKernel call,
    in CuPy's device and stream contexts."""
    spec = make_spec(GRID[0])
    if why is None:
        monkeypatch.setenv("TENSORSTEP_CUDA_LAUNCH", "cupy")
        backend = fake_cuda_backend(spec, monkeypatch, cupy)
    else:
        with pytest.warns(RuntimeWarning, match=re.escape(why)):
            backend = fake_cuda_backend(spec, monkeypatch, cupy)
    assert not backend.direct
    args = [0] * (len(abi.arguments("forward", table(spec))) - 1)
    backend.cupy.devices.clear()
    backend.call("forward", 300, args)
    assert backend.cupy.devices == [0] and [call[4] for call in backend.cupy.calls] == [7]


@pytest.mark.parametrize("overrides", [GRID[0], dict(control="acceleration", dt="per_step")],
                         ids=grid_id)
def test_host_run_follows_the_generated_launch_plan(overrides):
    """The host-run CUDA kernels launched by a plan with 64-thread blocks (dt_vjp's block sums and
    rows of partial sums then follow the plan's blocks): every launch has the plan's grid and
    block, and forward, adjoint and dt gradient match the C kernels (float64)."""
    spec = make_spec(overrides, dtype="float64")
    generated_plan = HostCudaBackend(spec).plan
    backend = HostCudaBackend(spec, small_blocks(generated_plan))
    host, cpu = Launcher(spec, backend), Launcher(spec, CpuBackend(spec))
    B = 150
    x = Inputs(spec, B, seed=5)
    dt = 0.02 + 0.02 * torch.rand(spec.n_dt, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    inputs = [getattr(x, a.c_name) for a in table(spec).tensors]
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(y.shape, dtype=torch.float64, generator=gen) for y in cpu.forward(inputs, dt)]
    for a, b in zip(host.forward(inputs, dt), cpu.forward(inputs, dt)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    needed = [True] * len(table(spec).differentiable)
    # the adjoint's sums run in another order on the plan's blocks than in C: compared at the scale of
    # each gradient (entries up to 5e5, 1/dt^3), not entry by entry, where one that cancels to 0.1
    # missed an absolute 1e-12 by a rounding of the large terms
    for a, b in zip(host.adjoint(grads, dt, B, needed), cpu.adjoint(grads, dt, B, needed)):
        scale_close(a.numpy(), b.numpy(), 1e-12)
    torch.testing.assert_close(host.dt_vjp(inputs, grads, dt), cpu.dt_vjp(inputs, grads, dt), rtol=1e-12, atol=1e-12)
    assert generated_plan.block(B) == 32
    assert {block for kernel, _, block in backend.launched if kernel in ("forward", "adjoint", "dt_vjp")} == {64}
    assert ("dt_vjp", -(-B * spec.dof // 64)) in [(kernel, grid) for kernel, grid, _ in backend.launched]


CAPTURED = [dict(control="acceleration", integrator="exact"), dict(difference="central", dt="per_step")]


@gpu
@pytest.mark.parametrize("overrides", CAPTURED, ids=grid_id)
def test_cuda_graph_capture_and_replay(overrides):
    """Forward and gradients (to u and a tensor dt) captured after prepare, replayed on new
    actions and new dt values (the coefficient table is filled again on every replay): the same
    numbers as eager calls; a float dt cached before capture is read on replay."""
    spec = make_spec(overrides)
    uniform = spec.dt == "uniform"
    dev = torch.device("cuda")
    step = ts.load(spec, dev).prepare(dt=0.05 if uniform else None, dt_grad=True)
    x = Inputs(spec, batch=300)  # B·D = 600: several blocks in the dt reduction
    u = x.u.to(dev).requires_grad_(True)
    starts = [t.to(dev) for t in (x.p0, x.v0, x.a0)]
    kw = {k: v.to(dev) for k, v in x.kwargs().items()}
    dt = (torch.tensor(0.05, dtype=torch.float64) if uniform else dt_value(spec)).to(dev).requires_grad_(True)

    def work():
        outs = step(u, *starts, dt, **kw)
        cost = sum(y.square().sum() for y in outs)
        floats = step(u.detach(), *starts, 0.05, **kw) if uniform else ()
        return (*torch.autograd.grad(cost, (u, dt)), *floats)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = work()
    for seed in (1, 2):
        with torch.no_grad():
            u.copy_(torch.randn(u.shape, generator=torch.Generator().manual_seed(seed), dtype=u.dtype).to(dev))
            dt.mul_(1.0 + 0.1 * seed)
        graph.replay()
        expected = work()
        for a, b in zip(captured, expected):
            assert torch.equal(a, b)
    if uniform:
        assert torch.equal(step(u.detach(), *starts, 0.05, **kw)[0],
                           step(u.detach(), *starts, torch.tensor(0.05, dtype=torch.float64, device=dev), **kw)[0])


# B·D = 700 (blocks of 32: the plan's for so small a batch) and 35,000 (137 blocks of 256, several
# warps per block, the last block partial)
SEVERAL_BLOCKS = [
    dict(difference="central", dt="per_step"),
    dict(difference="backward", accuracy=2, layout="bdh", start_index=True),
    dict(control="acceleration", integrator="exact", start_index=True),
    dict(control="jerk", dt="per_step", order=4),
    dict(dt="per_trajectory"),
    dict(dt="per_trajectory", control="acceleration", integrator="exact", start_index=True),
]


def _outputs_and_gradients(step, x: Inputs, dt: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Forward outputs and the gradients of a weighted sum of them to every input and to dt (on the CPU)."""
    inputs = [t.detach().to(device).requires_grad_(True) for t in (x.u, x.p0, x.v0, x.a0, x.j0)]
    dt = dt.to(device).requires_grad_(True)
    kw = {"start_index": x.idx.to(device)} if x.idx is not None else {}
    outs = step(*inputs[:4], dt, j0=inputs[4], **kw)
    weights = [torch.randn(y.shape, generator=torch.Generator().manual_seed(k), dtype=y.dtype).to(device)
               for k, y in enumerate(outs)]
    grads = torch.autograd.grad(outs, [*inputs, dt], weights)
    return [t.detach().cpu() for t in (*outs, *grads)]


@gpu
@pytest.mark.parametrize("B", [100, 5000])
@pytest.mark.parametrize("overrides", SEVERAL_BLOCKS, ids=grid_id)
def test_cuda_matches_cpu_over_several_blocks(overrides, B):
    """Forward, adjoint (every input) and dt gradients of B·D columns against the CPU kernels,
    float64."""
    _gpu_matches_cpu(make_spec(overrides, horizon=16, dof=7), B=B, rtol=1e-12)


def _gpu_matches_cpu(spec, B: int, rtol: float) -> None:
    x = Inputs(spec, batch=B)
    dt = _dt_of(spec, B)
    cpu = _outputs_and_gradients(ts.load(spec, "cpu"), x, dt, torch.device("cpu"))
    gpu = _outputs_and_gradients(ts.load(spec, "cuda"), x, dt, torch.device("cuda"))
    for a, b in zip(gpu, cpu):
        scale_close(a.numpy(), b.numpy(), rtol)


@gpu
def test_cuda_large_coefficient_table_matches_cpu():
    """Per-step H=256 float64: 3822 coefficients, too many for shared memory (read from the table in
    global memory); forward, adjoint and dt gradients against the CPU kernels."""
    spec = make_spec(dict(difference="central", dt="per_step"), horizon=256, dof=7)
    assert lowered(spec).n_coefficients * 8 > targets.CUDA_SHARED_COEF_BYTES
    _gpu_matches_cpu(spec, B=90, rtol=1e-11)


@gpu
@pytest.mark.parametrize("overrides", [SEVERAL_BLOCKS[0], SEVERAL_BLOCKS[2], SEVERAL_BLOCKS[4]], ids=grid_id)
def test_cuda_dt_gradient_is_bitwise_reproducible(overrides):
    """B·D = 2800 columns (11 blocks): the dt gradient is the same to the last bit on every run,
    and with torch.use_deterministic_algorithms(True)."""
    spec = make_spec(overrides, horizon=16, dof=7)
    x = Inputs(spec, batch=400)
    dt = _dt_of(spec, 400)
    step = ts.load(spec, "cuda")
    runs = [_outputs_and_gradients(step, x, dt, torch.device("cuda"))[-1] for _ in range(3)]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs.append(_outputs_and_gradients(step, x, dt, torch.device("cuda"))[-1])
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_start_state_gradient_of_shared_rows_is_bitwise_reproducible(dtype):
    """start_index with 40000 trajectories picking 3 start rows: the rows' gradients (each a sum of
    about 13,000 trajectories' gradients) are the same to the last bit on every call, and match the
    float64 sums of the per-trajectory gradients (runtime/rules.py ``scatter_rows``: CUDA's
    index_add added them with atomics, in an order that changed from run to run)."""
    B, rows = 40000, 3
    spec = make_spec(dict(start_index=True), horizon=16, dof=7).replace(dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    T = getattr(torch, dtype)
    u = torch.randn(B, spec.n_actions, spec.dof, generator=gen, dtype=torch.float64)
    starts = [torch.randn(rows, spec.dof, generator=gen, dtype=torch.float64) for _ in range(3)]
    index = torch.randint(0, rows, (B,), generator=gen)
    step = ts.load(spec, "cuda")

    def p0_gradient() -> torch.Tensor:
        p0 = starts[0].cuda().to(T).requires_grad_()
        ys = step(u.cuda().to(T), p0, *(s.cuda().to(T) for s in starts[1:]), 0.1, start_index=index.cuda())
        (grad,) = torch.autograd.grad(ys, (p0,), [torch.ones_like(y) for y in ys])
        return grad.cpu()

    runs = [p0_gradient() for _ in range(4)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    # every trajectory's p0 gradient is the same here (ones for every output), so the row's sum is
    # that gradient times how many trajectories picked it
    ones = torch.ones(1, spec.n_actions, spec.dof, dtype=torch.float64)
    cpu = ts.load(spec.replace(dtype="float64", start_index=False), "cpu")
    p0 = starts[0][:1].clone().requires_grad_()
    ys = cpu(ones, p0, *(s[:1] for s in starts[1:]), 0.1)
    (per_trajectory,) = torch.autograd.grad(ys, (p0,), [torch.ones_like(y) for y in ys])
    counts = torch.bincount(index, minlength=rows).double()[:, None]
    tol = 1e-12 if dtype == "float64" else 2e-3  # (float32: a sum of ~13,000 equal terms)
    torch.testing.assert_close(runs[0].double(), counts * per_trajectory, rtol=tol, atol=0)


@pytest.mark.parametrize("torch_cuda, runtime, nvrtc, fix", [
    ("13.0", 12080, (12, 8), "tensorstep[cuda13]"),       # cupy-cuda12x beside a CUDA 13 PyTorch
    ("12.8", 13000, (13, 0), "tensorstep[cuda12]"),
    ("12.8", 12080, OSError("libnvrtc.so.12: cannot open"), "cupy-cuda12x[ctk]"),
    ("13.0", 13000, (12, 9), "tensorstep[cuda13]"),
])
def test_cupy_of_another_cuda_major_is_refused_with_the_fix(torch_cuda, runtime, nvrtc, fix):
    from tensorstep.runtime.cuda_backend import CudaUnavailable, check_versions

    with pytest.raises(CudaUnavailable, match=re.escape(fix)):
        check_versions(torch_cuda, runtime, nvrtc)


def test_cupy_of_the_same_cuda_major_is_accepted():
    from tensorstep.runtime.cuda_backend import check_versions

    check_versions("12.8", 12060, (12, 6))
    check_versions("13.0", 13000, (13, 0))
