"""CUDA: generated sources compile to PTX everywhere (nvcc); kernels verified where a GPU exists."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

import reference
import tensorstep as ts
from cuda_on_host import host_source, host_metadata
from tensorstep.codegen import render
from tensorstep.runtime.api import Step
from tensorstep.runtime.launch import CpuBackend, Launcher
from tensorstep.runtime.verify import verify_launcher
from helpers import GRID, Inputs, dt_value, grid_id, make_spec, to_bhd
from test_numerics import scale_close

NVCC = shutil.which("nvcc")
HAS_GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401

    HAS_CUPY = True
except ImportError:
    HAS_CUPY = False

gpu = pytest.mark.skipif(not (HAS_GPU and HAS_CUPY), reason="needs an NVIDIA GPU and CuPy")
PTX_GRID = GRID + [dict(g, **{}) for g in GRID[:4]]


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("dtype, coefficients", [("float32", "shared"), ("float64", "shared"),
                                                 ("float64", "per-thread")])
def test_every_variant_compiles_to_ptx(tmp_path, dtype, coefficients, monkeypatch):
    """All variants of the grid, both dtypes, all kernels, in one translation unit per dtype;
    the step coefficients in shared memory, and per thread (tables too large to share)."""
    if coefficients == "per-thread":
        monkeypatch.setattr(render, "CUDA_SHARED_COEF_BYTES", 0)
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
    assert ptx.count(".entry") == 5 * len(GRID)


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
    assert torch.autograd.gradcheck(f, (*args, dt), check_forward_ad=True)
    g = lambda u, p0, v0, a0, j0: step(u, p0, v0, a0, dt.detach(), j0=j0, **kw)
    assert torch.autograd.gradgradcheck(g, tuple(args), check_fwd_over_rev=True)


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
    assert all(torch.allclose(a.cpu(), b) for a, b in zip(outs, ref))


# Integrator adjoints this long (float64) roll into a reverse loop for CUDA (render.CUDA_ROLL_ABOVE_BYTES):
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
    short = make_spec(INTEGRATORS[0], dtype="float32", horizon=32)
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


@pytest.mark.parametrize("form", ["straight", "rolled", "per-thread-coefficients"])
@pytest.mark.parametrize("overrides", GRID, ids=[grid_id(g) for g in GRID])
def test_cuda_source_run_on_the_host_matches_reference(overrides, form, monkeypatch):
    """The CUDA forward and adjoint, every thread of the grid run in turn on the host (no GPU
    needed): forward against the dense float64 operator, adjoint by the dot test."""
    if form == "rolled":
        if overrides.get("control", "position") == "position":
            pytest.skip("stencil adjoints are never rolled")
        monkeypatch.setattr(render, "CUDA_ROLL_ABOVE_BYTES", 0)
    if form == "per-thread-coefficients":
        monkeypatch.setattr(render, "CUDA_SHARED_COEF_BYTES", 0)
    spec = make_spec(overrides)
    source = host_source(spec)
    assert ("; --r)" in source) == (form == "rolled")
    assert ("__shared__ T coef" in source) == (form != "per-thread-coefficients")
    row = verify_launcher(spec, Launcher(spec, CpuBackend(spec, source, host_metadata(spec))), torch.device("cpu"), B=150)  # 2 blocks
    assert row["forward"] <= 1e-12 and row["adjoint"] <= 1e-12, row


@pytest.mark.parametrize("overrides", GRID, ids=[grid_id(g) for g in GRID])
def test_cuda_source_run_on_the_host_passes_gradcheck(overrides):
    """All five CUDA kernels run on the host behind the Python autograd path: gradients to every
    input and to dt (adjoint, dt_vjp, dt_vjp_finish) and forward mode (dt_jvp) against finite
    differences of the forward kernel."""
    spec = make_spec(overrides)
    step = Step(spec, torch.device("cpu"), Launcher(spec, CpuBackend(spec, host_source(spec), host_metadata(spec))))
    step.native = None
    x = Inputs(spec, batch=2)
    args = [t.detach().requires_grad_(True) for t in (x.u, x.p0, x.v0, x.a0, x.j0)]
    dt = dt_value(spec).requires_grad_(True)
    kw = {"start_index": x.idx} if x.idx is not None else {}
    f = lambda u, p0, v0, a0, j0, dt: step(u, p0, v0, a0, dt, j0=j0, **kw)
    assert torch.autograd.gradcheck(f, (*args, dt), check_forward_ad=True)
