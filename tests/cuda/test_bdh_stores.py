"""Layout "bdh": the per-element kernels that store rows stage them in shared memory, and a warp
then stores neighbouring addresses. The addresses a warp stores are worked out here from the
launch plan's blocks and the layout's strides (codegen/render.py ``strides``), as the kernel's
store loop takes them, and counted in 32-byte sectors against the thread-per-column stores the
staging replaced: a block's whole rows (element e of a block's stage, thread t taking e = t,
t + block, ...) where a warp's rows fit, else a warp's row tiles (codegen/targets.py
``cuda_tiles``: a window of R rows of the warp's n columns, element e by lane e % n, its k-th
store e // n). The host-run kernels (tests/cuda_on_host.py) record the tile stores they make,
whose sectors are counted the same way, each element stored once."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tensorstep as ts
from cuda_on_host import HostCudaBackend, host_source
from helpers import Inputs
from tensorstep.codegen import render, targets
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import generate
from tensorstep.codegen.render import ITEMSIZE, strides
from tensorstep.codegen.targets import CUDA_BLOCK, CUDA_STAGE_BYTES, CUDA_STAGED, CudaLaunchPlan
from tensorstep.runtime import cbackend
from tensorstep.runtime.launch import Launcher

SPECS = [dict(horizon=32, dof=7, layout="bdh"), dict(horizon=24, dof=10, dtype="float64", layout="bdh"),
         dict(horizon=53, dof=7, layout="bdh", control="bspline", degree=4, knots=8, steps=4)]
#: above the whole rows (float32 H > 64, float64 H > 32 at order 3): row tiles. Horizons whole
#: sectors (a sector's rows a window) and not (32 rows), N = H - 1 actions (32 rows), order 4
TILED = [dict(horizon=128, dof=7, layout="bdh"),
         dict(horizon=96, dof=7, layout="bdh", control="acceleration"),
         dict(horizon=70, dof=7, layout="bdh", difference="backward", accuracy=2),
         dict(horizon=64, dof=7, dtype="float64", layout="bdh", difference="backward", accuracy=2),
         dict(horizon=40, dof=10, dtype="float64", layout="bdh", control="jerk", integrator="exact", order=4),
         dict(dof=7, layout="bdh", control="bspline", degree=4, knots=16, steps=8)]
TILED_IDS = ["h128_f32", "h96_f32_acc", "h70_f32", "h64_f64", "h40_f64_o4", "bspline_h169_f32"]


def sectors(addresses: list[int], item: int) -> int:
    return len({a * item // 32 for a in addresses})


def _address(spec, rows: int, col: int, h: int) -> int:
    sb, sh, sd = strides(spec.layout, rows, spec.dof)
    return (col // spec.dof) * sb + h * sh + (col % spec.dof) * sd


def _rows(spec, kernel: str) -> int:
    return spec.horizon if CUDA_STAGED[kernel] == "outputs" else spec.n_actions


def _direct(spec, rows: int, cols: int, first: int) -> list[int]:
    """Sectors of each store of a warp whose lanes store a column each, a row at a time (unstaged)."""
    lanes = range(first, min(first + 32, cols))
    return [sectors([_address(spec, rows, c, h) for c in lanes], ITEMSIZE[spec.dtype]) for h in range(rows)]


@pytest.mark.parametrize("fields", SPECS, ids=["h32_f32", "h24_f64", "bspline_h53"])
@pytest.mark.parametrize("B", [400, 4000])
def test_a_warps_stores_are_contiguous(fields, B):
    spec = ts.KernelSpec(**fields)
    item = ITEMSIZE[spec.dtype]
    plan = generate(spec, targets=("cuda",)).launch_plan("cuda")
    assert plan.stage_columns >= 32 and not plan.tiles
    for kernel in CUDA_STAGED:
        rows = _rows(spec, kernel)
        (launch,) = [la for la in plan.launches(kernel, B).launches if la.kernel == kernel]
        block, cols = launch.block, B * spec.dof
        assert block <= plan.stage_columns and (spec.order + 1) * rows * item * block <= CUDA_STAGE_BYTES
        staged, direct = [], []
        for blk in range(launch.grid):
            col0 = blk * block
            n = min(block, cols - col0) * rows  # the block's staged elements
            for w in range(0, block, 32):
                for e0 in range(w, n, block):  # one store instruction of warp w
                    addresses = []
                    for e in range(e0, min(e0 + 32 - (e0 - w) % 32, n)):
                        col, h = divmod(col0 * rows + e, rows)
                        addresses.append(_address(spec, rows, col, h))
                    staged.append(sectors(addresses, item))
                if col0 + w < cols:
                    direct += _direct(spec, rows, cols, col0 + w)
        ideal = 32 * item // 32
        assert max(staged) <= ideal + 1  # a warp's 32 elements: ideal, one more where unaligned
        assert sum(staged) / len(staged) < 1.3 * ideal
        assert sum(direct) / len(direct) > 0.9 * 32  # before: a sector per lane


def _bound(spec, kernel: str, R: int) -> int:
    """The most sectors a warp's store of a tile touches: 32 / R columns of R rows each, a sector's
    rows a window where a column's rows are whole sectors (the ideal), else the columns' runs of R
    elements each one sector more than whole ones (32 rows: one column, the ideal and one more)."""
    item = ITEMSIZE[spec.dtype]
    per_sector = 32 // item
    if _rows(spec, kernel) % per_sector == 0 and R % per_sector == 0:
        return 32 * item // 32
    return (32 // R) * (R // per_sector + 1)


def _tile_stores(spec, kernel: str, R: int, block: int, grid: int, cols: int):
    """Per warp store of whole windows, its addresses (the model of the kernel's ts_tile_store)."""
    rows = _rows(spec, kernel)
    for blk in range(grid):
        for first in range(blk * block, min((blk + 1) * block, cols), 32):
            n = min(32, cols - first)
            for window in range(-(-rows // R)):
                for k in range(R):
                    elements = [k * n + lane for lane in range(n) if k * n + lane < n * R]
                    yield [_address(spec, rows, first + e // R, window * R + e % R)
                           for e in elements if window * R + e % R < rows]


@pytest.mark.parametrize("fields", TILED, ids=TILED_IDS)
@pytest.mark.parametrize("B", [400, 40000])
def test_a_warps_tile_stores_are_contiguous(fields, B):
    """Whole windows (every row of each window written before the warp stores it): each warp
    store within ``_bound`` sectors (4 / 8 in float32 / float64 for a sector's rows, one more
    with 32 rows), blocks of up to CUDA_BLOCK threads; against 32 sectors a row before."""
    spec = ts.KernelSpec(**fields)
    item = ITEMSIZE[spec.dtype]
    plan = generate(spec, targets=("cuda",)).launch_plan("cuda")
    assert plan.stage_columns == 0 and {kernel for kernel, _, _ in plan.tiles} == set(CUDA_STAGED)
    ideal = 32 * item // 32
    for kernel, R, columns in plan.tiles:
        rows = _rows(spec, kernel)
        arrays = spec.order + 1 if CUDA_STAGED[kernel] == "outputs" else 1
        assert arrays * columns * R * item <= CUDA_STAGE_BYTES and columns % 32 == 0
        if R == 32 // item and arrays <= 4:
            assert columns == CUDA_BLOCK  # a sector's rows up to order 3: blocks as unstaged
        if arrays == 1:
            assert columns >= CUDA_BLOCK // 2  # the adjoint's one array: 32 rows of 4 or 8 warps
        (launch,) = [la for la in plan.launches(kernel, B).launches if la.kernel == kernel]
        assert launch.block <= columns
        cols = B * spec.dof
        if B == 40000:  # a whole warp's every store (the grid's last warp partial or not): the first blocks
            grid = min(launch.grid, 4)
        else:
            grid = launch.grid
        counts = [sectors(a, item) for a in _tile_stores(spec, kernel, R, launch.block, grid, cols) if a]
        assert max(counts) <= _bound(spec, kernel, R)
        if R == 32 // item and rows % R == 0:
            assert max(counts) == ideal
        direct = [s for first in range(0, min(cols, 64 * 32), 32) for s in _direct(spec, rows, cols, first)]
        assert sum(direct) / len(direct) > 0.9 * 32


#: the most tile stores a host run below keeps
KEPT = 4_000_000


class _Blocks(CudaLaunchPlan):
    """The generated plan with blocks of CUDA_BLOCK threads at any batch (several warps a block on
    the host, where the plan's own blocks would take a batch too large to run)."""

    def block(self, B: int) -> int:
        return CUDA_BLOCK


@pytest.mark.parametrize("fields", TILED[:5], ids=TILED_IDS[:5])
def test_host_run_tile_stores_each_element_once_within_the_bound(fields):
    """The tile stores the host-run kernels make (forward, adjoint, dt_jvp; 12 trajectories of
    7 or 10 dof: a block of 256 threads, then a partial one whose last warp is partial), the
    partial windows too (a window whose rows the kernel writes in two parts, loops and boundary
    rows, is stored in two parts): every element of each staged output stored exactly once, each
    warp store within the whole windows' bound, and all of them in at most 1.4 times the sectors of the bytes stored (the partial windows and, with 32 rows, a
    sector more a store), at least 3 times fewer than a store per row (4 in float64, 8 in float32
    at most)."""
    spec = ts.KernelSpec(**fields)
    item = ITEMSIZE[spec.dtype]
    generated = generate(spec, targets=("cuda",)).launch_plan("cuda")
    plan = _Blocks(**{f.name: getattr(generated, f.name) for f in dataclasses.fields(generated) if f.init})
    backend = HostCudaBackend(spec, plan)
    launcher = Launcher(spec, backend)
    B = 40
    x = Inputs(spec, B, seed=3)
    args = table(spec)
    inputs = [getattr(x, a.c_name) for a in args.tensors]
    gen = torch.Generator().manual_seed(4)
    dt = torch.tensor(0.1, dtype=x.u.dtype)
    ddt = torch.tensor(0.3, dtype=x.u.dtype)
    tangents = [None if getattr(x, a.c_name) is None else torch.randn(getattr(x, a.c_name).shape, generator=gen,
                                                                      dtype=x.u.dtype) for a in args.differentiable]
    lib, ffi = backend.lib, backend.ffi
    tiles = {kernel: R for kernel, R, _ in plan.tiles}
    for kernel in CUDA_STAGED:
        lib.ts_take_stores(1, ffi.NULL, 0)
        if kernel == "forward":
            outs = launcher.forward(inputs, dt)
        elif kernel == "adjoint":
            grads = [torch.randn(y.shape, generator=gen, dtype=y.dtype) for y in ys]
            outs = launcher.adjoint(grads, dt, B, [True] * len(args.differentiable))[:1]
        else:
            outs = launcher.dt_jvp(inputs, tangents, dt, ddt)
        if kernel == "forward":
            ys = outs
        kept = ffi.new("ts_store[]", KEPT)
        n = lib.ts_take_stores(0, kept, KEPT)
        assert 0 < n < KEPT
        stored, warp_stores = {}, {}
        for s in kept[0:n]:
            assert s.bytes == item
            stored[s.address] = stored.get(s.address, 0) + 1
            warp_stores.setdefault((s.block, s.thread // 32, s.region, s.k), []).append(s.address)
        expected = {o.data_ptr() + i * item for o in outs for i in range(o.numel())}
        assert set(stored) == expected and set(stored.values()) == {1}, kernel
        counts = [len({a // 32 for a in addresses}) for addresses in warp_stores.values()]
        assert max(counts) <= _bound(spec, kernel, tiles[kernel]), kernel
        elements = sum(len(a) for a in warp_stores.values())
        rows = _rows(spec, kernel)
        # sectors the kernel's stores touch, against a store per row of each warp's columns
        # (h128_f32 forward: 19,880 against 17,920 ideal and 143,360 before)
        before = len(outs) * sum(sum(_direct(spec, rows, B * spec.dof, first)) for first in range(0, B * spec.dof, 32))
        assert sum(counts) <= 1.4 * elements * item / 32, kernel  # the ideal: the bytes' sectors
        assert sum(counts) < before / 3, kernel


BITWISE = [dict(horizon=40, dof=3, dtype="float64", layout="bdh"),
           dict(horizon=70, dof=3, layout="bdh", difference="backward", accuracy=2, end="one_sided"),
           dict(horizon=45, dof=3, dtype="float64", layout="bdh", control="jerk", integrator="exact", dt="per_step",
                start_index=True),
           dict(dof=3, dtype="float64", layout="bdh", control="bspline", degree=4, knots=6, steps=8)]


@pytest.mark.parametrize("fields", BITWISE, ids=["h40_f64", "h70_f32_one_sided", "h45_f64_jerk_per_step", "bspline_h89"])
def test_row_tiles_only_move_the_stores(fields, monkeypatch):
    """The host-run kernels with row tiles and without (a thread's stores of its column, rows
    apart) give the same outputs, gradients, dt gradient and dt tangent, bit for bit (23
    trajectories of 3 dof: three warps, the last partial), compiled without fused multiply-adds,
    which a host compiler may choose differently for either source."""
    spec = ts.KernelSpec(**fields)
    args = table(spec)
    B = 23
    x = Inputs(spec, B, seed=4)
    gen = torch.Generator().manual_seed(5)
    dtype = x.u.dtype
    inputs = [getattr(x, a.c_name) for a in args.tensors]
    dt = (0.05 + 0.1 * torch.rand(spec.n_dt, generator=gen, dtype=torch.float64)).to(dtype)
    ddt = torch.rand(spec.n_dt, generator=gen, dtype=torch.float64).to(dtype)
    tangents = [None if getattr(x, a.c_name) is None else torch.randn(getattr(x, a.c_name).shape, generator=gen,
                                                                      dtype=dtype) for a in args.differentiable]
    runs = []
    try:
        with monkeypatch.context() as m:
            m.setenv("TENSORSTEP_CFLAGS", "-ffp-contract=off")
            cbackend.c_flags.cache_clear()
            for tiled in (True, False):
                if not tiled:
                    m.setattr(render, "cuda_tiles", lambda *shape: {})
                    m.setattr(targets, "cuda_tiles", lambda *shape: {})
                backend = HostCudaBackend(spec)
                assert bool(backend.plan.tiles) == tiled and ("ts_tile_at" in host_source(spec)[0]) == tiled
                launcher = Launcher(spec, backend)
                ys = launcher.forward(inputs, dt)
                grads = [torch.randn(y.shape, generator=torch.Generator().manual_seed(6 + k), dtype=dtype)
                         for k, y in enumerate(ys)]
                gs = launcher.adjoint(grads, dt, B, [True] * len(args.differentiable))
                runs.append([*ys, *[g for g in gs if g is not None], launcher.dt_vjp(inputs, grads, dt),
                             *launcher.dt_jvp(inputs, tangents, dt, ddt)])
    finally:
        cbackend.c_flags.cache_clear()
    assert len(runs[0]) == len(runs[1]) and all(torch.equal(a, b) for a, b in zip(*runs))
    assert not any(bool(torch.isnan(a).any()) for a in runs[0])
