"""Layout "bdh": the per-element kernels that store rows stage them in shared memory, and a warp
then stores neighbouring addresses. The addresses a warp stores are worked out here from the
launch plan's blocks and the layout's strides (codegen/render.py ``strides``), as the kernel's
store loop takes them (element e of a block's stage, thread t taking e = t, t + block, ...), and
counted in 32-byte sectors against the thread-per-column stores the staging replaced."""
from __future__ import annotations

import pytest

import tensorstep as ts
from tensorstep.codegen.driver import generate
from tensorstep.codegen.render import ITEMSIZE, strides
from tensorstep.codegen.targets import CUDA_STAGE_BYTES, CUDA_STAGED

SPECS = [dict(horizon=32, dof=7, layout="bdh"), dict(horizon=24, dof=10, dtype="float64", layout="bdh"),
         dict(horizon=53, dof=7, layout="bdh", control="bspline", degree=4, knots=8, steps=4)]


def sectors(addresses: list[int], item: int) -> int:
    return len({a * item // 32 for a in addresses})


@pytest.mark.parametrize("fields", SPECS, ids=["h32_f32", "h24_f64", "bspline_h53"])
@pytest.mark.parametrize("B", [400, 4000])
def test_a_warps_stores_are_contiguous(fields, B):
    spec = ts.KernelSpec(**fields)
    item = ITEMSIZE[spec.dtype]
    plan = generate(spec, targets=("cuda",)).launch_plan("cuda")
    assert plan.stage_columns >= 32
    for kernel, stored in CUDA_STAGED.items():
        rows = spec.horizon if stored == "outputs" else spec.n_actions
        sb, sh, sd = strides(spec.layout, rows, spec.dof)
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
                        addresses.append((col // spec.dof) * sb + h * sh + (col % spec.dof) * sd)
                    staged.append(sectors(addresses, item))
                lanes = [c for c in range(col0 + w, min(col0 + w + 32, cols))]
                for h in range(rows) if lanes else ():  # a thread per column storing row h
                    direct.append(sectors([(c // spec.dof) * sb + h * sh + (c % spec.dof) * sd for c in lanes], item))
        ideal = 32 * item // 32
        assert max(staged) <= ideal + 1  # a warp's 32 elements: ideal, one more where unaligned
        assert sum(staged) / len(staged) < 1.3 * ideal
        assert sum(direct) / len(direct) > 0.9 * 32  # before: a sector per lane


def test_bhd_is_not_staged():
    spec = ts.KernelSpec(horizon=32, dof=7)
    assert generate(spec, targets=("cuda",)).launch_plan("cuda").stage_columns == 0
    assert "ts_stage" not in generate(spec, targets=("cuda",)).source("cuda")
