"""Test helpers: the variant grid, random inputs, layout conversion."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen.driver import generate
from tensorstep.runtime import cbackend

H, D = 7, 2


def scale_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """|actual - expected| ≤ rtol · max|expected| (derivative rows scale like 1/dt^k)."""
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(actual - expected).max())
    assert err <= rtol * scale, f"max error {err:.3e} > {rtol:.0e} x scale {scale:.3e}"

#: float64 gradcheck and gradgradcheck: PyTorch's step (eps), with tolerances float64 holds once each
#: output is divided by its own magnitude (``unit_outputs``). gradcheck's atol is absolute, while the
#: derivative rows scale like 1/dt^k and a central difference's rounding error like 1e-16·|y|/eps: with
#: the outputs as they are, that error (up to 5e-5 at eps 1e-6, velocity..snap rows of 1e3 to 5e5) is
#: what PyTorch's defaults (atol 1e-5, rtol 1e-3) let through; scaled, it is at most 2e-10 (linear
#: inputs) and 3e-8 for dt (truncation, eps²), against the Jacobian's entries.
GRADCHECK = dict(eps=1e-6, atol=1e-8, rtol=1e-6)


def unit_outputs(f, inputs):
    """``f`` with each output divided by its largest magnitude at ``inputs`` (a constant, at least 1)."""
    with torch.no_grad():
        ys = f(*[t.detach() for t in inputs])
    single = isinstance(ys, torch.Tensor)
    scales = [max(1.0, float(y.abs().max())) if y.numel() else 1.0 for y in ([ys] if single else ys)]

    def scaled(*args):
        ys = f(*args)
        return ys / scales[0] if single else tuple(y / s for y, s in zip(ys, scales))

    return scaled


def gradcheck64(f, inputs, **kwargs) -> bool:
    """torch.autograd.gradcheck of a float64 function at ``GRADCHECK``'s tolerances (``unit_outputs``)."""
    return torch.autograd.gradcheck(unit_outputs(f, inputs), inputs, **GRADCHECK, **kwargs)


def gradgradcheck64(f, inputs, **kwargs) -> bool:
    """torch.autograd.gradgradcheck of a float64 function at ``GRADCHECK``'s tolerances (``unit_outputs``)."""
    return torch.autograd.gradgradcheck(unit_outputs(f, inputs), inputs, **GRADCHECK, **kwargs)


#: A grid that covers every option of docs/semantics.md and docs/kernelspec.md (each row: KernelSpec overrides).
GRID = [
    dict(difference="backward", accuracy=1),
    dict(difference="backward", accuracy=2, dt="per_step"),
    dict(difference="backward", accuracy=(1, 2, 3), end="one_sided"),
    dict(difference="central"),
    dict(difference="central", end="one_sided"),
    dict(difference="central", accuracy=2, end="one_sided", dt="per_step"),
    dict(difference="central", accuracy=(2, 4, 2), dt="per_step"),
    dict(difference="central", accuracy=6, end="one_sided"),
    dict(difference="central", start_index=True, layout="bdh"),
    dict(difference="backward", accuracy=2, order=4),
    dict(difference="central", end="one_sided", order=4, dt="per_step"),
    dict(control="velocity"),
    dict(control="velocity", integrator="exact", dt="per_step", layout="bdh"),
    dict(control="acceleration"),
    dict(control="acceleration", integrator="exact", start_index=True),
    dict(control="acceleration", integrator="exact", dt="per_step", order=4),
    dict(control="jerk"),
    dict(control="jerk", integrator="exact", dt="per_step", start_index=True),
]


def c_functions(source: str) -> dict[str, str]:
    """The C functions of a generated source by name: their head line and body. An entry point's
    text ends with its batch function's (``<entry>_batch``, which holds the batch loop)."""
    heads = re.finditer(r"^(?:static )?(?:TS_\w+ )*void (\w+)\([^\n]*\)\n\{\n(.*?)\n\}\n", source, re.M | re.S)
    functions = {m.group(1): m.group(0) for m in heads}
    for name in list(functions):
        if f"{name}_batch" in functions:
            functions[name] += functions[f"{name}_batch"]
    return functions


#: straight-line integrators, whose C lane columns store each output row and load each gradient row at a
#: literal row (codegen/render.py ``whole_rows``, ``whole_loads``): float32 and float64, a dt per step,
#: D=3 (two rows a vector), order 4 with a start index
STRAIGHT_LINE_INTEGRATORS = [
    ts.KernelSpec(horizon=32, dof=7, dtype="float32", control="velocity"),
    ts.KernelSpec(horizon=24, dof=3, dtype="float32", control="acceleration", dt="per_step"),
    ts.KernelSpec(horizon=20, dof=7, dtype="float64", control="jerk", integrator="exact", order=4,
                  start_index=True),
]


def require_avx512() -> None:
    """Skip unless the C compiler, with the runtime's flags, targets AVX-512 (x86-64 only; the
    lane form compiles)."""
    probe = subprocess.run([cbackend.compiler(), *cbackend.c_flags(), "-dM", "-E", "-x", "c", "-"], input="",
                           capture_output=True, text=True)
    if "__AVX512F__" not in probe.stdout:
        pytest.skip("needs an x86-64 compiler targeting AVX-512 (-march=native on this machine)")


def compiler_output(spec: ts.KernelSpec, folder: Path, *stage: str, part: str = "core") -> str:
    """What the runtime's compiler and flags make of a spec's C kernels (the library ``part``)
    when stopped at ``stage``: ("-S",) the assembly, ("-E", "-P") the preprocessed source."""
    src, out = folder / "kernel.c", folder / "kernel.out"
    src.write_text(generate(spec, ("c",), (part,)).source("c", part))
    command = [a for a in cbackend.c_flags() if a != "-shared"]
    subprocess.run([cbackend.compiler(), *command, *stage, str(src), "-o", str(out)], check=True)
    return out.read_text()


def assembly(spec: ts.KernelSpec, folder: Path) -> str:
    """The assembly the runtime's compiler and flags make of a spec's C kernels."""
    return compiler_output(spec, folder, "-S")


def grid_id(overrides: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in overrides.items()) or "default"


def make_spec(overrides: dict, dtype: str = "float64", horizon: int = H, dof: int = D) -> ts.KernelSpec:
    return ts.KernelSpec(horizon=horizon, dof=dof, dtype=dtype, **overrides)


def dt_value(spec, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    """A valid dt tensor for a spec: scalar (uniform) or H random durations (per step)."""
    gen = torch.Generator().manual_seed(seed)
    if spec.dt == "uniform":
        dt = torch.tensor(0.1, dtype=torch.float64)
    else:
        dt = 0.05 + 0.1 * torch.rand(spec.horizon, generator=gen, dtype=torch.float64)
    return dt.to(torch.float32 if spec.dtype == "float32" else torch.float64).requires_grad_(requires_grad)


class Inputs:
    """Random inputs for a spec; `reference_start` gives the start rows each batch element uses."""

    def __init__(self, spec, batch: int = 3, seed: int = 0, requires_grad: bool = False, with_j0: bool = True):
        gen = torch.Generator().manual_seed(seed)
        dtype = torch.float32 if spec.dtype == "float32" else torch.float64
        self.spec = spec
        self.B = batch
        self.S = batch + 2 if spec.start_index else batch
        N, Dn = spec.n_actions, spec.dof
        shape = (batch, N, Dn) if spec.layout == "bhd" else (batch, Dn, N)
        rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
        self.u = rnd(*shape)
        self.p0, self.v0, self.a0 = rnd(self.S, Dn), rnd(self.S, Dn), rnd(self.S, Dn)
        self.j0 = rnd(self.S, Dn) if with_j0 else None
        self.idx = torch.randint(0, self.S, (batch,), generator=gen) if spec.start_index else None

    def kwargs(self) -> dict:
        kw = {}
        if self.j0 is not None:
            kw["j0"] = self.j0
        if self.idx is not None:
            kw["start_index"] = self.idx
        return kw

    def numpy_u_bhd(self) -> np.ndarray:
        u = self.u.detach().double().numpy()
        return u if self.spec.layout == "bhd" else u.transpose(0, 2, 1)

    def numpy_start(self) -> np.ndarray:
        """[B, 4, D] start state of each batch element (j0 zero when absent)."""
        rows = [self.p0, self.v0, self.a0, self.j0 if self.j0 is not None else torch.zeros_like(self.p0)]
        s = torch.stack([r.detach().double() for r in rows], 1).numpy()
        return s[self.idx.numpy()] if self.idx is not None else s


def to_bhd(y: torch.Tensor, spec) -> np.ndarray:
    y = y.detach().double().numpy()
    return y if spec.layout == "bhd" else y.transpose(0, 2, 1)


def dt_gradient(spec, x: "Inputs", dt: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The dt gradient of Σ g·Y for random output gradients g (fixed seed), and g itself as
    [K, B, H, D] (bhd), for comparing against differences of the reference."""
    outs = ts.load(spec, "cpu")(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs]
    (got,) = torch.autograd.grad(outs, [dt], gs)
    return got.numpy(), np.stack([to_bhd(gk, spec) for gk in gs])


def kernel_paths(spec):
    """(name, step) for the C kernels behind the native node and behind the Python autograd path,
    and for the CUDA source run on the host (tests/cuda_on_host.py)."""
    from cuda_on_host import host_step

    yield "c", ts.load(spec)
    python = ts.load(spec)
    python.native = None
    yield "c-python", python
    yield "cuda-on-host", host_step(spec)


def as_bhd(y: torch.Tensor, spec) -> np.ndarray:
    """An output as a NumPy array in layout bhd."""
    y = y.detach().numpy()
    return y if spec.layout == "bhd" else y.transpose(0, 2, 1)


def check_compile_matches_eager(loss, args: list) -> None:
    """torch.compile(fullgraph=True) of a scalar loss gives the eager value and gradients (1e-12)."""
    eager = loss(*args)
    eager_grads = torch.autograd.grad(eager, args)
    torch._dynamo.reset()
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*args)
    grads = torch.autograd.grad(value, args)
    torch.testing.assert_close(value, eager, rtol=1e-12, atol=0)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def check_ptx(sources: list, tmp_path) -> None:
    """nvcc compiles the CUDA sources (one namespace each) to PTX with every CUDA kernel of each: every
    entry point (codegen/abi.py), less the table kernels where the threads compute their
    coefficients (a dt per trajectory: no table)."""
    import shutil
    import subprocess

    from tensorstep.codegen import abi

    kernels = len(abi.cuda_kernels(abi.PARTS["all"]))
    expected = sum(kernels - (2 if "each thread computes them from the powers" in src else 0) for src in sources)
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(f"namespace v{i} {{\n{src}\n}}" for i, src in enumerate(sources)).replace(
        'extern "C" ', ""))
    result = subprocess.run([shutil.which("nvcc"), "-ptx", "-arch=sm_80", str(unit), "-o", str(tmp_path / "o.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "o.ptx").read_text().count(".entry") == expected


class BoundaryCase:
    """Random float64 inputs of a spec with a start and maybe a goal state (each optionally indexed),
    in call order: u, p0, v0, a0, j0, [gp, gv, ga, gj], dt (uniform, per step or per trajectory)."""

    def __init__(self, spec, B: int = 3, seed: int = 0, uniform_dt: float = 0.1):
        gen = torch.Generator().manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
        self.spec, self.B = spec, B
        S = B + 2 if spec.start_index else B
        G = B + 1 if spec.goal_index else B
        N, Dn = spec.n_actions, spec.dof
        self.u = rnd(*((B, N, Dn) if spec.layout == "bhd" else (B, Dn, N)))
        self.start = [rnd(S, Dn) for _ in range(4)]
        self.goal = [rnd(G, Dn) for _ in range(4)] if spec.end == "goal" else []
        self.idx = torch.randint(0, S, (B,), generator=gen) if spec.start_index else None
        self.gidx = torch.randint(0, G, (B,), generator=gen) if spec.goal_index else None
        if spec.dt == "per_step":
            self.dt = 0.05 + 0.1 * torch.rand(spec.horizon, generator=gen, dtype=torch.float64)
        elif spec.dt == "per_trajectory":
            self.dt = 0.05 + 0.1 * torch.rand(B, generator=gen, dtype=torch.float64)
        else:
            self.dt = torch.tensor(uniform_dt, dtype=torch.float64)

    def tensors(self) -> list[torch.Tensor]:
        """The differentiable inputs: u, p0, v0, a0, j0, goal..., dt."""
        return [self.u, *self.start, *self.goal, self.dt]

    def call(self, step, u, p0, v0, a0, j0, *rest, out=None):
        *goal, dt = rest
        kw = {"start_index": self.idx} if self.idx is not None else {}
        if goal:
            kw.update(goal=tuple(goal), goal_index=self.gidx)
        if out is not None:
            kw["out"] = out
        return step(u, p0, v0, a0, dt, j0=j0, **kw)

    def check_kernels(self, expect: np.ndarray) -> None:
        """Every kernel path's outputs against ``expect`` ([K, B, H, D], bhd; the first K outputs),
        and the gradients of every input by the dot test against that forward:
        <M x, g> = <x, Mᵀ g>, at 1e-12 of Σ|g·Mx| (C, Python path, CUDA on the host, on the Python
        path and on the native node's CUDA launches)."""
        from cuda_on_host import host_step

        spec, K = self.spec, len(expect)
        gen = torch.Generator().manual_seed(5)
        grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64)
                 for y in self.call(ts.load(spec), *self.tensors())[:K]]
        dot = sum(float((as_bhd(g, spec) * e).sum()) for g, e in zip(grads, expect))
        # the sum's rounding is relative to its terms, which cancel heavily with wide stencils
        size = max(1.0, sum(float(np.abs(as_bhd(g, spec) * e).sum()) for g, e in zip(grads, expect)))
        for name, step in [*kernel_paths(spec), ("cuda-on-host-native", host_step(spec, native=True))]:
            xs = [t.clone().requires_grad_(True) for t in self.tensors()[:-1]]
            ys = self.call(step, *xs, self.dt)
            assert len(ys) == spec.order + 1
            for y, e in zip(ys, expect):
                scale_close(as_bhd(y, spec), e, 1e-12)
            gx = torch.autograd.grad(ys[:K], xs, grads)
            total = sum(float((x.detach() * g).sum()) for x, g in zip(xs, gx))
            assert abs(total - dot) <= 1e-12 * size, (name, total, dot, size)

    def check_compile(self) -> None:
        """torch.compile(fullgraph=True) of a loss over every output matches eager (value, gradients)."""
        step = ts.load(self.spec)

        def loss(*a):
            return sum(w * y.square().sum() for w, y in zip((1.0, 0.1, 0.01, 0.001), self.call(step, *a)))

        check_compile_matches_eager(loss, [t.clone().requires_grad_(True) for t in self.tensors()])

    def check_gradcheck(self) -> None:
        """Gradients and forward-mode tangents of every input, dt included, against finite
        differences (C kernels and the CUDA source on the host); double backward for the tensors."""
        args = [t.clone().requires_grad_(True) for t in self.tensors()]
        for name, step in kernel_paths(self.spec):
            f = lambda *a: self.call(step, *a)
            assert gradcheck64(f, args, check_forward_ad=True), name
        g = lambda *a: self.call(ts.load(self.spec), *a, self.dt)
        assert gradgradcheck64(g, args[:-1])


class ReferenceCase(BoundaryCase):
    """Random inputs of any spec and the independent float64 references' outputs for them:
    tests/reference.py (position and integration control), tests/reference_bspline.py (SciPy)."""

    def expected(self) -> np.ndarray:
        """Reference outputs [K, B, H, D] (bhd): every output, or P..J for a B-spline."""
        spec = self.spec
        u = self.u.numpy() if spec.layout == "bhd" else self.u.numpy().transpose(0, 2, 1)
        pick = lambda rows, index: torch.stack(rows, 1)[index if index is not None else slice(None)].numpy()
        s = pick(self.start, self.idx)  # [B, 4, D]
        g = pick(self.goal, self.gidx) if self.goal else None
        per_trajectory = spec.dt == "per_trajectory"
        if spec.control == "bspline":  # dt uniform or per trajectory
            import reference_bspline

            return np.stack([reference_bspline.trajectory(
                u[b], list(s[b]), None if g is None else list(g[b]), spec.degree, spec.steps,
                float(self.dt[b] if per_trajectory else self.dt)).Y for b in range(self.B)], 1)
        import reference

        out = np.zeros((spec.order + 1, self.B, spec.horizon, spec.dof))
        for b in range(self.B):
            dt = self.dt[b].item() if per_trajectory else self.dt.reshape(-1).tolist()
            for d in range(spec.dof):
                out[:, b, :, d] = reference.column(spec, u[b, :, d], s[b, :, d], dt,
                                                   None if g is None else g[b, :, d])
        return out


def check_dt_derivatives(case: ReferenceCase, paths, h: float = 1e-4, rtol: float = 1e-8) -> None:
    """dt's gradient (dt_vjp) and tangent (dt_jvp) on each (name, step) of ``paths`` against the
    reference's derivative in dt along a direction r: Richardson-extrapolated central differences
    (error O(h⁴)), float64. r is 1 for a uniform dt, 1 per trajectory (each trajectory reads only
    its own) and random per step; the gradient is compared as <gradient, r> per step."""
    import torch.autograd.forward_ad as fwAD

    dt0 = case.dt.clone()
    per_step = case.spec.dt == "per_step"
    r = (0.5 + torch.rand(dt0.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
         if per_step else torch.ones_like(dt0))

    def reference(dt: torch.Tensor) -> np.ndarray:
        case.dt = dt
        return case.expected()

    def slope(step: float) -> np.ndarray:
        return (reference(dt0 + step * r) - reference(dt0 - step * r)) / (2 * step)

    derivative = (4 * slope(h / 2) - slope(h)) / 3  # [K, B, H, D] in bhd
    case.dt = dt0
    gen = torch.Generator().manual_seed(3)
    ys = case.call(ts.load(case.spec), *case.tensors())[: len(derivative)]
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ys]
    per_b = np.einsum("kbrd,kbrd->b", np.stack([as_bhd(g, case.spec) for g in grads]), derivative)
    expect_grad = per_b if case.spec.dt == "per_trajectory" else per_b.sum()
    for name, step in paths:
        dt = dt0.clone().requires_grad_(True)
        ys = case.call(step, *case.tensors()[:-1], dt)[: len(derivative)]
        (gdt,) = torch.autograd.grad(ys, dt, grads)
        got = (gdt * r).sum() if per_step else gdt
        scale_close(np.atleast_1d(got.numpy()), np.atleast_1d(expect_grad), rtol)
        with fwAD.dual_level():
            ys = case.call(step, *case.tensors()[:-1], fwAD.make_dual(dt0.clone(), r.clone()))[: len(derivative)]
            tangents = np.stack([as_bhd(fwAD.unpack_dual(y).tangent, case.spec) for y in ys])
        scale_close(tangents, derivative, rtol)
