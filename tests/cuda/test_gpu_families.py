"""Every kernel family on the GPU against the C kernels on the CPU (forward and adjoint), float64.

The families are the argument tables of codegen/arguments.py: tensorstep's own (position
stencils, integrators, B-splines, a goal end, start and goal tables picked by index) and
cuRobo's (compat: v0.7's kernels; v2's have their own GPU test in tests/compat/test_compat_v2.py).
Inputs are made from each table alone, so a new family needs only a spec in FAMILIES. The
batch spans several blocks. Without a GPU these tests skip; the same comparison runs on the
host with the CUDA source run thread by thread (tests/cuda_on_host.py), which checks this
file's own logic where CI has no GPU.
"""
from __future__ import annotations

import re

import pytest
import torch

import tensorstep as ts
from cuda_on_host import HostCudaBackend
from helpers import make_spec, scale_close
from tensorstep.codegen import abi
from tensorstep.codegen.arguments import ABSENT, INDEX, table
from tensorstep.codegen.curobo_v2_spec import CuroboV2Spec
from tensorstep.codegen.legacy_spec import LegacySpec
from tensorstep.runtime.cuda_backend import cuda_source, entry_points
from tensorstep.runtime.launch import Launcher

try:
    import cupy  # noqa: F401

    HAS_CUPY = True
except ImportError:
    HAS_CUPY = False

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_CUPY), reason="needs an NVIDIA GPU and CuPy")

BSPLINE = dict(control="bspline", degree=4, knots=8, steps=4, dof=7, dtype="float64")
FAMILIES = {
    "central-per-step": make_spec(dict(difference="central", dt="per_step"), horizon=16, dof=7),
    "backward-bdh-indexed": make_spec(dict(difference="backward", accuracy=2, layout="bdh", start_index=True),
                                      horizon=16, dof=7),
    "jerk-exact-per-trajectory": make_spec(dict(control="jerk", integrator="exact", dt="per_trajectory"),
                                           horizon=16, dof=7),
    "velocity-semi-implicit": make_spec(dict(control="velocity"), horizon=16, dof=7),
    "goal-indexed": ts.KernelSpec(horizon=16, dof=7, end="goal", goal_index=True, start_index=True,
                                  dtype="float64"),
    "bspline": ts.KernelSpec(**BSPLINE),
    "bspline-goal-per-trajectory": ts.KernelSpec(**BSPLINE, end="goal", dt="per_trajectory"),
    "curobo-clique-central": LegacySpec("clique_central", 16, 7, "float64", start_index=True),
    "curobo-accel-rk2": LegacySpec("accel_rk2", 16, 7, "float64"),
}


def _inputs(launcher: Launcher, B: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random inputs of the launcher's table (tables of B + 3 rows where an index picks them), and
    a dt of its shape with distinct positive entries."""
    table = launcher.table
    gen = torch.Generator().manual_seed(seed)
    dims = {"B": B, "S": B + 3, "G": B + 3}
    inputs = []
    for arg in table.tensors:
        shape = table.physical(arg, dims)
        if arg.presence == ABSENT:  # (this spec of the family goes without it)
            inputs.append(None)
        elif arg.dtype == INDEX:
            inputs.append(torch.randint(0, B + 3, shape, generator=gen))
        else:
            inputs.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(launcher.dtype))
    dt = 0.03 + 0.04 * torch.rand(table.physical(table.dt, dims), generator=gen, dtype=torch.float64)
    return inputs, dt.to(launcher.dtype)


def _run(launcher: Launcher, inputs: list, dt: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Forward outputs and the adjoint's gradients of every differentiable input (to the CPU)."""
    inputs = [t if t is None else t.to(device) for t in inputs]
    dt = dt.to(device)
    outs = launcher.forward(inputs, dt)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype).to(device) for y in outs]
    B = inputs[0].shape[0]
    gs = launcher.adjoint(grads, dt, B, (True,) * len(launcher.table.differentiable))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [t.cpu() for t in (*outs, *gs) if t is not None]


def _matches_cpu(spec, device_launcher: Launcher, device: torch.device, B: int) -> None:
    cpu = ts.load(spec, "cpu").launcher
    inputs, dt = _inputs(cpu, B)
    expected = _run(cpu, inputs, dt, torch.device("cpu"))
    got = _run(device_launcher, inputs, dt, device)
    assert len(got) == len(expected) > len(cpu.table.outputs)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        scale_close(a.numpy(), b.numpy(), 1e-12)


@gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_on_the_gpu_matches_the_cpu(name):
    """B=300 at 7 dof: 2,100 columns, 66 blocks of 32 (the launch plan's block for so small a
    batch), the last one partial."""
    spec = FAMILIES[name]
    _matches_cpu(spec, ts.load(spec, "cuda").launcher, torch.device("cuda"), B=300)


@pytest.mark.parametrize("name", ["backward-bdh-indexed", "goal-indexed", "bspline"])
def test_the_comparison_itself_on_the_host(name):
    """This file's comparison with the CUDA source run on the host (blocks of 32): its inputs,
    shapes and gradients are right for tables with indices, a goal and B-spline control."""
    spec = FAMILIES[name]
    _matches_cpu(spec, Launcher(spec, HostCudaBackend(spec)), torch.device("cpu"), B=40)


ENTRY_POINT_SPECS = {
    **FAMILIES,
    "costs-per-trajectory": make_spec(dict(dt="per_trajectory", costs=(("squared", "velocity"),), outputs=("P",)),
                                      horizon=8, dof=3),
    "curobo-v2-clique": CuroboV2Spec("clique", 12, 2, "float64"),
}


@pytest.mark.parametrize("name", ENTRY_POINT_SPECS)
def test_the_backend_binds_the_kernels_each_library_defines(name):
    """The entry points the CUDA backend binds by name are exactly the kernels each library's
    source defines (a missing one fails on a GPU as "named symbol not found"; a dt per
    trajectory computes its coefficients in each thread and has no table kernel)."""
    spec = ENTRY_POINT_SPECS[name]
    args = table(spec)
    for part in ("core", "dt_jvp", "dt_vjp"):
        if not abi.part_kernels(part, args):
            continue
        source, metadata = cuda_source(spec, part)
        defined = set(re.findall(r'extern "C" __global__ (?:__launch_bounds__\([^)]*\) )?void (\w+)\(', source))
        assert {abi.symbol(spec.name, k) for k in entry_points(args, part, metadata)} == defined, part
