"""float32's unfused CUDA kernels with a dt per trajectory, run on the host (tests/cuda_on_host.py,
every thread): the adjoint's and dt_jvp's coefficients are float products of the monomials'
factors and the thread's powers of its dt (codegen/targets.py ``cuda_float_powers``), which moves
each by a rounding of float. Forward, gradients and dt's tangent against float64 references at
1e-5 of each output's scale; with one kernel's float powers scaled by ``SCALED``, its check fails.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import cuda_on_host
import tensorstep as ts
from cuda_on_host import host_source, host_step
from helpers import ReferenceCase, as_bhd, make_spec, scale_close

SPECS = [dict(control="bspline", degree=5, knots=7, steps=3, order=4),
         dict(control="bspline", degree=4, knots=6, steps=2), dict(difference="central", horizon=9),
         dict(difference="backward", accuracy=3, order=4, horizon=12),
         dict(control="jerk", integrator="exact", horizon=9)]
RTOL = 1e-5
#: what a kernel's float powers are scaled by where a test checks that its check sees them
SCALED = 1.0001
#: the line of each kernel that rounds the thread's powers to float (templates/kernel.cu.j2)
FLOAT_POWERS = {"adjoint": "ts_fpw[ts_e] = (float)ts_pw[ts_e];",
                "dt_jvp": "ts_fdpw[ts_e] = (float)(ts_dpw[ts_e] * ts_ddt);"}


def _spec(overrides: dict, dtype: str) -> ts.KernelSpec:
    fields = dict(overrides, dt="per_trajectory")
    if fields.get("control") == "bspline":  # the horizon follows from knots and steps
        return ts.KernelSpec(dof=2, dtype=dtype, **fields)
    return make_spec(fields, dtype=dtype, horizon=fields.pop("horizon"), dof=2)


def _ids(overrides: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in overrides.items())


def _check(spec32: ts.KernelSpec, spec64: ts.KernelSpec, h: float = 1e-4) -> None:
    """The float32 kernels run on the host against float64 references, at ``RTOL`` of each scale:
    the outputs against the dense reference; the gradients of every input but dt against the
    float64 C step's; dt's gradient and tangent against Richardson-extrapolated central differences
    of the reference in dt (each trajectory's own)."""
    case = ReferenceCase(spec64, B=3, seed=4)
    dt0 = case.dt.clone()

    def slope(step: float) -> np.ndarray:
        case.dt = dt0 + step
        ahead = case.expected()
        case.dt = dt0 - step
        behind = case.expected()
        return (ahead - behind) / (2 * step)

    derivative = (4 * slope(h / 2) - slope(h)) / 3  # [K, B, H, D]
    case.dt = dt0
    expected = case.expected()
    K = len(expected)
    xs64 = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    ys64 = case.call(ts.load(spec64), *xs64, dt0)[:K]
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ys64]
    expect_x = torch.autograd.grad(ys64, xs64, grads)
    expect_dt = np.einsum("kbrd,kbrd->b", np.stack([as_bhd(g, spec64) for g in grads]), derivative)

    step = host_step(spec32)
    xs = [t.float().requires_grad_(True) for t in case.tensors()[:-1]]
    dt = dt0.float().requires_grad_(True)
    ys = case.call(step, *xs, dt)[:K]
    for y, e in zip(ys, expected):
        scale_close(as_bhd(y.double(), spec32), e, RTOL)
    *gx, gdt = torch.autograd.grad(ys, [*xs, dt], [g.float() for g in grads])
    for got, want in zip(gx, expect_x):
        scale_close(got.double().numpy(), want.numpy(), RTOL)
    scale_close(gdt.double().numpy(), expect_dt, RTOL)
    with fwAD.dual_level():
        ys = case.call(step, *[x.detach() for x in xs], fwAD.make_dual(dt0.float(), torch.ones_like(dt0.float())))[:K]
        tangents = np.stack([as_bhd(fwAD.unpack_dual(y).tangent.double(), spec32) for y in ys])
    scale_close(tangents, derivative, RTOL)


@pytest.mark.parametrize("overrides", SPECS, ids=_ids)
def test_float32_float_products_run_on_the_host_match_float64_references(overrides, monkeypatch):
    spec32, spec64 = _spec(overrides, "float32"), _spec(overrides, "float64")
    source, _ = host_source(spec32)
    text = lambda source, kernel: source[source.index(f"void {spec32.name}_{kernel}_thread("):]
    for kernel, line in FLOAT_POWERS.items():
        assert line in text(source, kernel).split("\n}\n")[0], kernel
    _check(spec32, spec64)
    for kernel, line in FLOAT_POWERS.items():
        def scaled(spec, kernel=kernel, line=line):
            source, declarations = host_source(spec)
            at = source.index(line, source.index(f"void {spec.name}_{kernel}_thread("))
            return source[:at] + line[:-1] + f" * {SCALED!r}f;" + source[at + len(line):], declarations

        monkeypatch.setattr(cuda_on_host, "host_source", scaled)
        with pytest.raises(AssertionError):
            _check(spec32, spec64)
        monkeypatch.undo()
