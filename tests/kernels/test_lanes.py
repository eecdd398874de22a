"""The C kernels' two column forms: all dof in one masked vector (AVX-512), and the per-dof loop.

Each form is checked against the dense reference: forward outputs and the adjoint (the
gradient of <outputs, g> with respect to u and the start state, as reference transposes).
The vector form compiles only where the compiler targets AVX-512 (VL); elsewhere both
parametrisations run the per-dof loop.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen import render as render_module
from tensorstep.codegen.driver import generate, lowered
from tensorstep.codegen.render import lanes
from tensorstep.runtime import validate
from tensorstep.runtime.launch import CpuBackend, Launcher

import reference
from helpers import GRID, Inputs, assembly, dt_value, grid_id, make_spec, require_avx512, scale_close
from sweep import FULL

# dof and dtype pick the vector: float64 D=3 (256 bits), float64 D=7 and float32 D=12 (512 bits),
# float32 D=17 (more than one vector holds: per-dof loop only)
CASES = [
    dict(dof=3, dtype="float64", difference="central"),
    dict(dof=7, dtype="float64", control="acceleration", integrator="exact"),
    dict(dof=12, dtype="float32", difference="backward", accuracy=2),
    dict(dof=17, dtype="float32", control="jerk"),
    # a long horizon: the integrator's lane body is rolled (one loop over the rows)
    dict(horizon=150, dof=7, dtype="float64", control="acceleration"),
]
TOL = {"float64": 1e-12, "float32": 2e-5}


def spec_of(case: dict) -> ts.KernelSpec:
    return ts.KernelSpec(**{"horizon": 9, **case})


def check_against_reference(spec: ts.KernelSpec, outs: list[np.ndarray], grads: dict[str, np.ndarray],
                            inputs: dict[str, np.ndarray], g: list[np.ndarray]) -> None:
    start = np.stack([inputs[n] for n in ("p0", "v0", "a0", "j0")], axis=1)
    expected = reference.apply(spec, [0.05], inputs["u"], start)
    expect_u, expect_start = reference.apply_adjoint(spec, [0.05], np.stack(g))
    tol = TOL[spec.dtype]
    for k, y in enumerate(outs):
        scale_close(y, expected[k], tol)
    scale_close(grads["u"], expect_u, tol)
    for m, name in enumerate(("p0", "v0", "a0", "j0")):
        scale_close(grads[name], expect_start[:, m], tol)


RUN = textwrap.dedent(
    """
    import json, sys, numpy as np, torch, tensorstep as ts
    case, data = json.loads(sys.argv[1]), np.load(sys.argv[2])
    spec = ts.KernelSpec(**{"horizon": 9, **case})
    dtype = torch.float32 if spec.dtype == "float32" else torch.float64
    x = {n: torch.tensor(data[n], dtype=dtype, requires_grad=True) for n in ("u", "p0", "v0", "a0", "j0")}
    outs = ts.load(spec)(x["u"], x["p0"], x["v0"], x["a0"], 0.05, j0=x["j0"])
    g = [torch.tensor(data[f"g{k}"], dtype=dtype) for k in range(len(outs))]
    grads = torch.autograd.grad(outs, list(x.values()), g)
    np.savez(sys.argv[3], **{f"y{k}": y.detach().double().numpy() for k, y in enumerate(outs)},
             **{n: t.double().numpy() for n, t in zip(x, grads)})
    """
)


def _same_build(case: dict, lane_form) -> bool:
    """Whether a form runs what another case's form runs: float32 D=17 has no lanes (each switch builds the
    per-dof loop again), and the intrinsics at H=150 are float64 D=7's macros (H=9's), the rolled body
    being the vector lanes' own."""
    return (case["dof"] == 17 and lane_form is not True) or ("horizon" in case and lane_form == "intrinsics")


COLUMN_FORMS = [(case, form) for case in CASES for form in (True, "intrinsics", False)
                if FULL or not _same_build(case, form)]
FORM_IDS = {True: "vector-lanes", "intrinsics": "vector-lanes-immintrin", False: "per-dof-loop"}


@pytest.mark.parametrize("case, lane_form", COLUMN_FORMS,
                         ids=[f"{c['dtype']}-D{c['dof']}-H{c.get('horizon', 9)}-{FORM_IDS[f]}" for c, f in COLUMN_FORMS])
def test_column_forms_match_reference(case, lane_form, tmp_path):
    spec = spec_of(case)
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    assert ("#if defined(TS_LANES)" in source) == (lanes(spec) is not None)
    gen = np.random.default_rng(0)
    B, D = 5, spec.dof
    inputs = {"u": gen.standard_normal((B, spec.n_actions, D))}
    inputs.update({n: gen.standard_normal((B, D)) for n in ("p0", "v0", "a0", "j0")})
    g = [gen.standard_normal((B, spec.horizon, D)) for _ in range(spec.order + 1)]
    if spec.dtype == "float32":  # the reference sees exactly the values the kernel gets
        inputs = {n: v.astype(np.float32).astype(np.float64) for n, v in inputs.items()}
        g = [v.astype(np.float32).astype(np.float64) for v in g]
    np.savez(tmp_path / "in.npz", **inputs, **{f"g{k}": v for k, v in enumerate(g)})
    env = dict(os.environ)
    # the generated code's own switches (a different flag is a different cache entry): the
    # per-dof loop, or the lanes through <immintrin.h> as where the compiler lacks the builtins
    switch = {False: " -DTS_NO_LANES", "intrinsics": " -DTS_LANE_INTRINSICS"}.get(lane_form, "")
    env["TENSORSTEP_CFLAGS"] = (env.get("TENSORSTEP_CFLAGS", "") + switch).strip()
    run = subprocess.run([sys.executable, "-c", RUN, json.dumps(case), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = np.load(tmp_path / "out.npz")
    outs = [out[f"y{k}"] for k in range(spec.order + 1)]
    grads = {n: out[n] for n in ("u", "p0", "v0", "a0", "j0")}
    check_against_reference(spec, outs, grads, inputs, g)


def test_integrator_lane_bodies_do_not_grow_with_the_horizon():
    """Rolled: the lane form's forward and adjoint are the same length at H=32 and H=256 (and
    so stay under the lane form's length limit), while the per-dof bodies grow with H."""
    from tensorstep.codegen.printer import COLUMN

    short, long = (lowered(ts.KernelSpec(horizon=H, dof=7, control="acceleration", integrator="exact"))
                   for H in (32, 256))
    for kernel in ("forward", "adjoint"):
        a, b = (COLUMN.lines(getattr(code, f"{kernel}_rolled")) for code in (short, long))
        assert len(a) == len(b) and any(line.startswith("for (int64_t r") for line in b)
        assert len(getattr(long, kernel).body) > 6 * len(getattr(short, kernel).body)
    source = generate(ts.KernelSpec(horizon=256, dof=7, control="acceleration"), ("c",), ("core",)).source("c", "core")
    assert source.count("for (int64_t r = 2; r <= 255; ++r)") == 1  # forward, in the lane block
    assert source.count("for (int64_t r = 254; r >= 1; --r)") == 1  # the adjoint's reverse scan


INTEGRATORS = [g for g in GRID if g.get("control", "position") != "position"]


@pytest.mark.parametrize("overrides", INTEGRATORS, ids=[grid_id(g) for g in INTEGRATORS])
def test_rolled_lane_columns_match_reference(overrides, monkeypatch):
    """Every integrator of the grid with its lane columns rolled (forced here; by default only
    bodies too long for straight-line lanes roll): outputs and adjoint against the reference,
    per-step dt and start_index included. Without AVX-512 this checks the per-dof form."""
    spec = make_spec(overrides, horizon=9, dof=3)
    if lanes(spec) is None:
        pytest.skip("layout bdh has no lane form")
    monkeypatch.setattr(render_module, "ROLL_ABOVE_LINES", 0)
    source = generate(spec, ("c",)).source("c")
    core = generate(spec, ("c",), ("core",)).source("c", "core")
    # the adjoint's reverse scan and the forward loop (per-step dt adds the coefficient program's row
    # loop, whose rows a CUDA block's threads share: r += TS_THREADS)
    assert core.count("--r) {") == 1 and core.count("++r) {") == 1
    assert core.count("r += TS_THREADS) {") == (1 if spec.dt == "per_step" else 0)
    launcher = Launcher(spec, CpuBackend(spec, source))
    x = Inputs(spec, batch=4)
    dt = dt_value(spec)
    dt_k = validate.dt_tensor(dt, launcher.table, torch.float64, torch.device("cpu"))
    ys = launcher.forward([x.u.detach(), x.p0, x.v0, x.a0, x.j0, x.idx], dt_k)
    expected = reference.apply(spec, dt.reshape(-1).tolist(), x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(ys):
        scale_close(y.numpy(), expected[k], 1e-12)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ys]
    gu, *gs = launcher.adjoint(grads, dt_k, x.B, (True,) * 5)
    expect_u, expect_start = reference.apply_adjoint(spec, dt.reshape(-1).tolist(), np.stack([g.numpy() for g in grads]))
    scale_close(gu.numpy(), expect_u, 1e-12)
    for m in range(4):
        scale_close(gs[m].numpy(), expect_start[:, m], 1e-12)


def _masked_loads(text: str, function: str) -> int:
    """Masked (zeroing) vector loads in one function of an assembly listing."""
    body = re.search(rf"^{function}[.\w]*:\n(.*?)\.cfi_endproc", text, re.M | re.S)
    assert body, function
    return len(re.findall(r"vmovup[sd]\s+[^\n]*\(%\w+[^\n]*\{%k\d\}\{z\}", body.group(1)))


def test_a_bspline_forward_loads_each_action_row_once(tmp_path):
    """Every output row of a B-spline reads degree + 1 action rows, so each row is read by dozens
    of row expressions. GCC takes a masked store for one that may alias any later load and
    loaded a row again wherever it was read (hundreds of masked loads per batch element, about
    half of the forward's time); the lane body now loads every action row once, up front. An
    integrator's forward, which reads each row once, keeps reading rows in place."""
    require_avx512()
    bspline = ts.KernelSpec(dof=7, control="bspline", degree=4, knots=8, steps=4)
    text = assembly(bspline, tmp_path)
    rows = bspline.n_actions + 4  # the action rows and the start state
    assert _masked_loads(text, f"{bspline.name}_forward_batch") <= rows
    integrator = generate(ts.KernelSpec(horizon=32, dof=7, control="acceleration"), ("c",), ("core",)).source("c", "core")
    assert "ua_[N_]" not in integrator and "ua_[N_]" in generate(bspline, ("c",), ("core",)).source("c", "core")
