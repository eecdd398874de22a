"""Layout "bhd": the per-element kernels whose staged rows fit (codegen/targets.py
``cuda_bhd_stage``) take blocks of whole trajectories, copy the rows they read into shared memory
and stage the rows they write, which the block then stores in order. The launch plan and the
source of the bench's fused step are checked for it; the addresses a warp loads and stores are
worked out from the plan's blocks (as the kernels' copy and store loops take them) and counted in
32-byte sectors against a thread per column's row accesses; and the staged kernels run on the
host (tests/cuda_on_host.py), blocks of several sizes with a partial last one, match the C
kernels in float64."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tensorstep as ts
from cuda_on_host import host_step
from tensorstep.bench.costs import TERMS
from tensorstep.codegen import targets
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import generate
from tensorstep.codegen.render import ITEMSIZE
from tensorstep.codegen.targets import (CUDA_BHD_STAGED, CUDA_STAGE_BYTES, cuda_bhd_arrays, cuda_bhd_stride,
                                        cuda_bhd_trajectories)

#: the bench's fused step (bench/costs.py): seven cost terms, P written, float32, H=32, D=7
BENCH = ts.KernelSpec(horizon=32, dof=7, costs=TERMS, outputs=("P",))


def _sectors(elements: list[int], item: int) -> int:
    return len({e * item // 32 for e in elements})


def test_the_bench_fused_step_stages_whole_trajectories():
    """Its forward and adjoint: blocks of whole trajectories (13 and 9 of D = 7), a grid of
    ceil(B / trajectories) blocks, the staged rows within CUDA_STAGE_BYTES; the source copies u
    (and the adjoint P's gradient) into shared memory and stores P (the adjoint u's gradient)
    from it."""
    generated = generate(BENCH, targets=("cuda",))
    plan = generated.launch_plan("cuda")
    assert dict(plan.bhd_stage) == {"forward": 96, "adjoint": 64}
    item = ITEMSIZE[BENCH.dtype]
    for kernel, columns in plan.bhd_stage:
        read_u, read_y, write_u, write_y = cuda_bhd_arrays(kernel, table(BENCH))
        per = ((read_u + write_u) * cuda_bhd_stride(BENCH.n_actions, BENCH.dof)
               + (read_y + write_y) * cuda_bhd_stride(BENCH.horizon, BENCH.dof))
        assert cuda_bhd_trajectories(columns, BENCH.dof) * per * item <= CUDA_STAGE_BYTES
        (launch,) = [la for la in plan.launches(kernel, 40000).launches if la.kernel == kernel]
        k = columns // BENCH.dof
        assert (launch.block, launch.grid) == (columns, -(-40000 // k))
    source = generated.source("cuda")
    forward = source[source.index("_forward(int64_t B"):source.index("_adjoint(int64_t B")]
    adjoint = source[source.index("_adjoint(int64_t B"):source.index("_cost_sum(int64_t B")]
    assert "ts_su[e + e / (unsigned)TS_NU" in forward and "ts_to[e] = ts_sy0[" in forward
    assert "ts_sg0[e + e / (unsigned)TS_NY" in adjoint and "ts_to[e] = ts_sgu[" in adjoint


def test_other_layouts_large_stages_and_b_splines_are_not_staged():
    """Layout bdh stages its own way; a stage that would leave a block fewer than 64 threads (the
    plain step's four outputs in float64, H=32) is not taken: blocks as before; nor is a B-spline's."""
    assert generate(BENCH.replace(layout="bdh"), targets=("cuda",)).launch_plan("cuda").bhd_stage == ()
    bspline = ts.KernelSpec(dof=7, horizon=None, control="bspline", degree=3, knots=8, steps=4, dtype="float64")
    assert generate(bspline, targets=("cuda",)).launch_plan("cuda").bhd_stage == ()
    plain = ts.KernelSpec(horizon=32, dof=7, dtype="float64")
    plan = generate(plain, targets=("cuda",)).launch_plan("cuda")
    assert plan.bhd_stage == ()
    (launch,) = plan.launches("forward", 40000).launches
    assert (launch.block, launch.grid) == (256, -(-40000 * 7 // 256))


@pytest.mark.parametrize("kernel", CUDA_BHD_STAGED)
@pytest.mark.parametrize("B", [400, 40001])
def test_a_warps_loads_and_stores_are_contiguous(kernel, B):
    """Each warp access of the block's copies and stores (element e by thread e % block): 32
    neighbouring elements, 4 sectors in float32 (5 where unaligned), where a thread per column's
    row access touched 8.7 on average (D = 7: about five trajectories' pieces of 7 elements)."""
    plan = generate(BENCH, targets=("cuda",)).launch_plan("cuda")
    item, D = ITEMSIZE[BENCH.dtype], BENCH.dof
    (launch,) = [la for la in plan.launches(kernel, B).launches if la.kernel == kernel]
    k = launch.block // D
    staged, direct = [], []
    for rows in (BENCH.n_actions, BENCH.horizon):
        for blk in range(min(launch.grid, 8)) if B > 400 else range(launch.grid):
            n = min(k, B - blk * k) * rows * D  # the block's trajectories' elements of one array
            base = blk * k * rows * D
            for w in range(0, launch.block, 32):
                for e0 in range(w, n, launch.block):  # one warp access of the copy or store loop
                    staged.append(_sectors([base + e for e in range(e0, min(e0 + 32, n))], item))
        for first in range(0, min(B * D, 8 * 256), 32):  # unstaged: warps of 32 columns from column 0
            cols = range(first, min(first + 32, B * D))
            direct += [_sectors([(c // D) * rows * D + h * D + c % D for c in cols], item) for h in range(rows)]
    ideal = 32 * item // 32
    assert max(staged) <= ideal + 1
    assert sum(staged) / len(staged) < 1.25 * ideal
    assert sum(direct) / len(direct) > 2 * ideal  # 8.7 at D = 7


#: float64 specs whose forward and adjoint are staged: the bench's terms at H=12 (the adjoint
#: recomputes from u: u, P's gradient and u's gradient staged), the plain step at H=8 (four
#: outputs), an integrator with cost terms and two outputs
STAGED = [dict(horizon=12, dof=7, costs=TERMS, outputs=("P",)),
          dict(horizon=8, dof=7),
          dict(horizon=10, dof=3, control="jerk", integrator="exact", costs=TERMS, outputs=("P", "A"))]


def _plan(spec, fill_blocks: int, monkeypatch):
    """A fresh launch plan whose blocks fill CUDA_FILL_BLOCKS = ``fill_blocks`` (large blocks for a small batch)."""
    monkeypatch.setattr(targets, "CUDA_FILL_BLOCKS", fill_blocks)
    generated = generate(spec, targets=("cuda",))
    return targets.CUDA.launch_plan(spec, generated.metadata)


def _run(step, spec, B: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    D = spec.dof
    u = r(B, spec.n_actions, D).requires_grad_()
    starts = [r(B, D) for _ in range(spec.order)]
    params = {}
    for kind, state in spec.costs:
        params[f"{kind}_{state}_weight"] = r(B, D).abs() + 0.1
        if kind == "bound":
            lo = -0.3 - r(D).abs()
            params[f"bound_{state}_limit"] = torch.stack([lo, lo + 0.5 + r(D).abs()])
            params[f"bound_{state}_margin"] = 0.05 * r(D).abs()
    outs = step(u, *starts, 0.07, **params)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    sum((o * r(*o.shape)).sum() for o in outs).backward()
    return [*(o.detach() for o in outs), u.grad]


@pytest.mark.parametrize("fields", STAGED, ids=["fused_h12", "plain_h8", "jerk_exact"])
@pytest.mark.parametrize("fill_blocks", [1, 132])
def test_staged_kernels_run_on_the_host_match_c(fields, fill_blocks, monkeypatch):
    """B = 23: with CUDA_FILL_BLOCKS = 1 the plan's largest blocks (several trajectories a block, the
    last block partial), with 132 blocks of a warp (32 // D trajectories); the states, the cost and
    u's gradient are the C kernels' to 1e-12."""
    spec = ts.KernelSpec(dtype="float64", **fields)
    plan = _plan(spec, fill_blocks, monkeypatch)
    assert {k for k, _ in plan.bhd_stage} == set(CUDA_BHD_STAGED)
    B = 23
    for kernel, _ in plan.bhd_stage:
        (launch,) = [la for la in plan.launches(kernel, B).launches if la.kernel == kernel]
        k = launch.block // spec.dof
        assert launch.grid == -(-B // k) and (launch.grid == 1 or B % k)  # a partial last block
    expected = _run(ts.load(spec), spec, B)
    got = _run(host_step(spec, plan), spec, B)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12 * float(e.abs().max()))
