"""`tensorstep bench --cuda-plan`: the launches it reports are those the CUDA kernels run on the host
are launched with (tests/cuda_on_host.py, through the runtime's Launcher), the temporaries' bytes
those counted buffer by buffer here, and ptxas's figures cover every kernel launched."""
from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

import tensorstep as ts
from cuda_on_host import HostCudaBackend
from helpers import Inputs
from tensorstep.bench import ptxas
from tensorstep.cli import main
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import generate
from tensorstep.runtime.launch import CpuBackend, Launcher

SPECS = [  # (CLI options, the KernelSpec they give)
    (["--horizon", "8", "--dof", "3", "--dtype", "float64"], dict(horizon=8, dof=3, dtype="float64")),
    (["--horizon", "8", "--dof", "3", "--dt", "per_step"], dict(horizon=8, dof=3, dt="per_step")),
    (["--horizon", "6", "--dof", "2", "--control", "acceleration"], dict(horizon=6, dof=2, control="acceleration")),
    (["--horizon", "6", "--dof", "2", "--control", "acceleration", "--dt", "per_step"],
     dict(horizon=6, dof=2, control="acceleration", dt="per_step")),
    (["--dof", "2", "--control", "bspline", "--degree", "3", "--knots", "5", "--steps", "2", "--dt", "per_trajectory"],
     dict(dof=2, control="bspline", degree=3, knots=5, steps=2, dt="per_trajectory")),
]
IDS = ["uniform", "per_step", "accel", "accel_per_step", "bspline_per_trajectory"]


def table_kernel(fields: dict) -> bool:
    """Whether a kernel fills a coefficient table in global memory: only a stencil with a dt per
    step (its boundary rows are a straight-line program, run once per call). Monomials of one dt
    and an integrator's per-step rows are computed by each per-element kernel's block (or thread)."""
    return fields.get("dt") == "per_step" and fields.get("control", "position") == "position"


def plan_json(options: list[str], batches: tuple[int, ...], *extra: str) -> list[dict]:
    args = ["bench", "--cuda-plan", "--json", *extra, *options]
    for B in batches:
        args += ["--batch", str(B)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("options,fields", SPECS, ids=IDS)
def test_reported_launches_are_those_the_runtime_makes(options, fields):
    """Each operation's launches (kernel, grid, block) as the host-run CUDA kernels record them when
    the runtime's Launcher runs a forward, an adjoint, then an adjoint and a dt gradient."""
    spec = ts.KernelSpec(**fields)
    B = 150
    (report,) = plan_json(options + ["--no-ptxas"], (B,))
    assert report["spec"] == spec.name
    backend = HostCudaBackend(spec)
    launcher = Launcher(spec, backend)
    x = Inputs(spec, B, seed=3)
    dt = torch.full((spec.n_dt,) if spec.dt != "per_trajectory" else (B,), 0.03, dtype=launcher.dtype)
    inputs = [getattr(x, a.c_name) for a in table(spec).tensors]
    grads = [torch.ones_like(y) for y in launcher.forward(inputs, dt)]
    needed = [True] * len(table(spec).differentiable)
    recorded = {}
    for name, run in (("forward", lambda: launcher.forward(inputs, dt)),
                      ("backward", lambda: launcher.adjoint(grads, dt, B, needed)),
                      ("backward_dt", lambda: (launcher.adjoint(grads, dt, B, needed),
                                               launcher.dt_vjp(inputs, grads, dt)))):
        backend.launched.clear()
        run()
        recorded[name] = list(backend.launched)
    operations = report["batches"][0]["operations"]
    for name, launched in recorded.items():
        assert [(l["kernel"], l["grid"], l["block"]) for l in operations[name]["launches"]] == launched, name
        assert all(l["shared"] == 0 for l in operations[name]["launches"])


def test_temporaries_counted_buffer_by_buffer():
    """The bytes per call against a count of each buffer: a table of the coefficients per fill
    (float32; only a per-step stencil's: ``table_kernel``, and none for a stencil's dt_vjp), dt_vjp's float64 partial sums (a row per block of dt_vjp, with its warps'
    rows where they do not fit in shared memory, or with a dt per trajectory one double per
    trajectory: each thread adds up its trajectory's dt gradient), the float64 sums of the block rows, an integrator's forward outputs, the dt gradient in dt's
    dtype (float32)."""
    B = 1000
    for options, fields in SPECS[1:]:
        spec = ts.KernelSpec(**fields)
        nc = generate(spec, targets=("cuda",), parts=("core",)).n_coefficients
        (report,) = plan_json(options + ["--no-ptxas"], (B,))
        ops = report["batches"][0]["operations"]
        table_bytes = nc * 4 if table_kernel(fields) else 0
        assert ops["forward"]["temporary_bytes"] == table_bytes
        assert ops["backward"]["temporary_bytes"] == table_bytes
        dt_vjp = [l for l in ops["backward_dt"]["launches"] if l["kernel"] == "dt_vjp"]
        warp_rows = 1 if 8 * nc * 8 <= 32 * 1024 else dt_vjp[0]["block"] // 32  # in shared memory, else in gc
        gc = B if spec.dt == "per_trajectory" else dt_vjp[0]["grid"] * warp_rows * nc  # (a thread's own dt gradient)
        integrator = spec.control == "acceleration"
        values = 4 * B * spec.horizon * spec.dof * 4 if integrator else 0  # P, V, A, J
        fills = 1  # the adjoint's (a stencil's dt_vjp reads none)
        sums = 0 if spec.dt == "per_trajectory" else nc * 8
        n_dt = {"uniform": 1, "per_step": spec.horizon, "per_trajectory": B}[spec.dt]
        expect = fills * table_bytes + gc * 8 + sums + values + n_dt * 4
        assert ops["backward_dt"]["temporary_bytes"] == expect, fields


def test_backward_with_a_dt_gradient_is_at_most_four_launches():
    """The adjoint, dt_vjp (a stencil's reads no table), dt_vjp_finish (which adds dt_vjp's rows:
    no dt_vjp_sum); an integrator adds the forward whose values dt_vjp reads; only a per-step
    stencil fills a table, once (``table_kernel``): elsewhere each per-element kernel's block or
    thread computes its coefficients. dt_vjp's grid
    stops growing at 264 blocks (its rows of partial sums with it); with a dt per trajectory it
    runs a thread per trajectory, whose sums are B rows (not B x dof)."""
    B = 40000
    for options, fields in SPECS:
        (report,) = plan_json(options + ["--no-ptxas"], (B, 10 ** 6))
        for batch in report["batches"]:
            launches = [l["kernel"] for l in batch["operations"]["backward_dt"]["launches"]]
            integrator = fields.get("control") == "acceleration"
            expect = (["adjoint", "forward", "dt_vjp", "dt_vjp_finish"] if integrator
                      else ["coefficients", "adjoint", "dt_vjp", "dt_vjp_finish"] if table_kernel(fields)
                      else ["adjoint", "dt_vjp", "dt_vjp_finish"])
            assert launches == expect and len(launches) <= 4, fields
            for name in ("forward", "backward"):
                kernels = [l["kernel"] for l in batch["operations"][name]["launches"]]
                assert kernels == ["coefficients"] * table_kernel(fields) + [name.replace("backward", "adjoint")]
            (dt_vjp,) = [l for l in batch["operations"]["backward_dt"]["launches"] if l["kernel"] == "dt_vjp"]
            if fields.get("dt") == "per_trajectory":
                assert dt_vjp["grid"] * dt_vjp["block"] >= batch["batch"] > (dt_vjp["grid"] - 1) * dt_vjp["block"]
            else:
                assert dt_vjp["grid"] == 264 and dt_vjp["block"] == 256


@pytest.mark.parametrize("options,fields", SPECS, ids=IDS)
def test_per_element_kernels_bound_the_plans_blocks(options, fields):
    """Each per-element kernel's __launch_bounds__ cover every block the plan launches it with and
    ask for as many resident blocks as cap a thread at 128 of an SM's 65,536 registers; the kernels
    run once per call or per trajectory have none (their register use is not capped)."""
    spec = ts.KernelSpec(**fields)
    generated = generate(spec, targets=("cuda",))
    source, plan = generated.source("cuda"), generated.launch_plan("cuda")
    for kernel in ("forward", "adjoint", "dt_vjp", "dt_jvp"):
        found = re.search(rf'__global__ __launch_bounds__\((\d+), (\d+)\) void {spec.name}_{kernel}\(', source)
        assert found, kernel
        threads, blocks = int(found[1]), int(found[2])
        assert 65536 // (threads * blocks) == 128
        for B in (1, 100, 400, 4000, 40000, 10 ** 6):
            assert all(0 < l.block <= threads for l in plan.launches(kernel, B).launches if l.kernel == kernel)
    # table kernels (defined, and run where a table is too large to share); none with a dt per trajectory
    tables = () if spec.dt == "per_trajectory" else ("coefficients", "coefficients_jvp")
    for kernel in (*tables, "dt_vjp_finish"):
        assert f'__global__ void {spec.name}_{kernel}(' in source, kernel


def test_block_size_follows_the_batch():
    """Blocks of 256 threads where that gives a grid of at least 132 blocks (an H100's SMs), else
    halved down to a warp; the once-per-call kernels keep 256."""
    plan = generate(ts.KernelSpec(horizon=32, dof=7, dt="per_step"), targets=("cuda",), parts=("core",)).launch_plan("cuda")
    expect = {1: 32, 400: 32, 1000: 32, 1300: 64, 2000: 64, 2700: 128, 4000: 128, 4800: 256, 40000: 256, 10 ** 6: 256}
    assert {B: plan.block(B) for B in expect} == expect
    for B in expect:
        (table_fill, forward) = plan.launches("forward", B).launches
        assert (table_fill.grid, table_fill.block) == (1, 256)
        assert forward.block == expect[B] and forward.grid == -(-B * 7 // expect[B])
        assert forward.grid >= 132 or forward.block == 32


def _host_dt_gradient_matches_c(spec, B: int, spread: float) -> HostCudaBackend:
    """The host-run CUDA dt gradient (durations in [0.02, 0.02 + spread)) the same bit for bit twice,
    and the C kernels' to 1e-12; the host backend, for its launches."""
    backend = HostCudaBackend(spec)
    host, cpu = Launcher(spec, backend), Launcher(spec, CpuBackend(spec))
    x = Inputs(spec, B, seed=5)
    n_dt = B if spec.dt == "per_trajectory" else spec.n_dt
    dt = 0.02 + spread * torch.rand(n_dt, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    inputs = [getattr(x, a.c_name) for a in table(spec).tensors]
    grads = [torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
             for y in cpu.forward(inputs, dt)]
    first = host.dt_vjp(inputs, grads, dt)
    assert torch.equal(first, host.dt_vjp(inputs, grads, dt))
    torch.testing.assert_close(first, cpu.dt_vjp(inputs, grads, dt), rtol=1e-12, atol=1e-12)
    return backend


@pytest.mark.parametrize("B,dt,H", [(150, "per_step", 8), (3000, "per_step", 8), (25000, "uniform", 8),
                                    (700, "per_trajectory", 8), (3000, "per_step", 36)])
def test_dt_gradient_with_the_plans_blocks_is_deterministic_and_matches_c(B, dt, H):
    """The host-run CUDA kernels at the block size the plan picks for B (blocks of 32, 15 of them;
    of 64, 141; of 256, 264, whose threads take a second column past 67,584; a thread per
    trajectory; 522 coefficients, whose warp rows are in gc, not in shared memory): the dt gradient
    (dt_vjp's warp and block sums, added in order) is the same bit for bit on every run, and the C
    kernels' to 1e-12."""
    spec = ts.KernelSpec(horizon=H, dof=3, dtype="float64", dt=dt)
    backend = _host_dt_gradient_matches_c(spec, B, 0.02)
    launched = {(grid, block) for kernel, grid, block in backend.launched if kernel == "dt_vjp"}
    expect = {150: (15, 32), 3000: (141, 64), 25000: (264, 256), 700: (22, 32)}[B]
    shared_rows = "__shared__ double ts_warp_rows" in generate(spec, targets=("cuda",)).source("cuda")
    assert shared_rows == (H == 8 and spec.dt != "per_trajectory")
    assert launched == {expect} and B * (1 if spec.dt == "per_trajectory" else 3) > (expect[0] - 1) * expect[1]


@pytest.mark.parametrize("fields", [dict(control="bspline", degree=5, knots=6, steps=2),
                                    dict(horizon=8, control="acceleration", integrator="exact"),
                                    dict(horizon=8, difference="central")],
                         ids=["bspline", "acceleration-exact", "central"])
def test_a_dt_per_trajectory_is_added_up_in_each_thread_and_matches_c(fields):
    """With a dt per trajectory each thread of dt_vjp adds its terms times their coefficients' dt
    derivatives into its trajectory's dt gradient: one double per trajectory (not one per
    coefficient), cast by dt_vjp_finish, a thread per trajectory. The host-run CUDA kernels' dt
    gradient is the C kernels' to 1e-12 (float64; B = 300 trajectories, two blocks of 256 in the
    finish) and the same bit for bit twice."""
    spec = ts.KernelSpec(dof=3, dtype="float64", dt="per_trajectory", **fields)
    B = 300
    backend = _host_dt_gradient_matches_c(spec, B, 0.05)
    assert backend.plan.dt_vjp_size(B) == B
    assert [(k, grid, block) for k, grid, block in backend.launched if k == "dt_vjp_finish"] == [("dt_vjp_finish", 2, 256)] * 2


@pytest.mark.parametrize("args,message", [
    (["--control", "bspline", "--degree", "9"], "KernelSpec.degree=9 is invalid"),
    (["--batch", "0"], "--batch=0: expected a positive integer"),
    (["--device", "cuda"], "--cuda-plan takes the spec options, --batch and --json, not --device"),
    (["--order", "5"], "'5' is not one of '3', '4'"),
])
def test_a_bad_option_is_a_one_line_error(args, message):
    result = CliRunner().invoke(main, ["bench", "--cuda-plan", "--no-ptxas", *args])
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error") or "Error" in line]) == 1


def test_spec_options_without_cuda_plan_are_refused():
    result = CliRunner().invoke(main, ["bench", "--control", "bspline", "--json"])
    assert result.exit_code != 0
    assert result.output.strip() == "error: --json, --control: only with --cuda-plan (the spec whose launches it reports)"


@pytest.mark.skipif(ptxas.nvcc() is None, reason="nvcc not found on PATH: no ptxas figures")
def test_ptxas_figures_cover_every_launched_kernel():
    options, _ = SPECS[1]
    (report,) = plan_json(options, (400,))
    assert report["ptxas"]["error"] == ""
    launched = {l["kernel"] for op in report["batches"][0]["operations"].values() for l in op["launches"]}
    kernels = report["ptxas"]["kernels"]
    assert launched <= set(kernels)
    assert all(k["registers"] > 0 and k["spill_stores"] >= 0 and k["stack"] >= 0 for k in kernels.values())
    result = CliRunner().invoke(main, ["bench", "--cuda-plan", *options, "--batch", "400"])
    assert result.exit_code == 0 and "| dt_vjp | " in result.output and "| forward (2) |" in result.output


@pytest.mark.parametrize("fields", [dict(horizon=8, dof=3, dt="per_step"),
                                    dict(horizon=6, dof=2, control="acceleration"),
                                    dict(dof=2, control="bspline", degree=3, knots=5, steps=2, dt="per_trajectory"),
                                    dict(horizon=8, dof=3, costs=(("bound", "velocity"), ("squared", "jerk")),
                                         outputs=("P",))],
                         ids=["per_step", "accel", "bspline_per_trajectory", "fused"])
def test_bind_gives_each_launch_its_arguments_by_name(fields):
    """runtime/cuda_backend.py ``bind`` (positions worked out once per plan's launches) passes each
    launch what its arguments name: the call's argument of that name in the entry point's order,
    a temporary's buffer, or the integer itself, as a lookup by name gives them; the buffers are
    the temporaries' sizes and dtypes. A call with another count of arguments is refused."""
    from tensorstep.codegen import abi
    from tensorstep.runtime.cuda_backend import bind

    spec = ts.KernelSpec(**fields)
    plan = generate(spec, targets=("cuda",)).launch_plan("cuda")
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for kernel in abi.part_kernels("all", table(spec)):
        for B in (1, 5, 300):
            launches = plan.launches(kernel, B)
            args = torch.randint(1, 2**40, (len(launches.parameters),), generator=gen).tolist()
            for _ in range(2):  # the second call reuses the positions worked out on the first
                bound, buffers = bind(launches, args, lambda size, dtype: torch.empty(size, dtype=dtype))
                by_name = dict(zip(launches.parameters, args))
                by_name.update((t.name, b.data_ptr()) for t, b in zip(launches.temporaries, buffers))
                assert [(b.numel(), str(b.dtype)) for b in buffers] == [
                    (t.size, f"torch.{t.dtype}") for t in launches.temporaries]
                assert len(bound) == len(launches.launches)
                for (name, grid, block, shared, values), launch in zip(bound, launches.launches):
                    assert (name, grid, block, shared) == (launch.kernel, launch.grid, launch.block, launch.shared)
                    assert list(values) == [a if isinstance(a, int) else by_name[a] for a in launch.args]
                    checked += len(values)
            with pytest.raises(ValueError, match=f"expected {len(args)} arguments"):
                bind(launches, args[:-1], lambda size, dtype: torch.empty(size, dtype=dtype))
    assert checked > 0
