"""CUDA's per-column values in the thread's column of shared memory (codegen/targets.py
``cuda_shared_column``) only where a fused column's loop holds the most values: the float64 adjoints
whose loop reads many values defined before it keep their scaled cost weights there. Elsewhere the
weights stay in registers, and every forward keeps its cost sums in registers."""
from __future__ import annotations

import pytest

import tensorstep as ts
from tensorstep.codegen import driver
from tensorstep.codegen.shared_column import loop_live_in
from tensorstep.codegen.targets import CUDA_SHARED_WEIGHTS_LIVE

#: bench/costs.py's seven terms (``TERMS``; that module imports torch, which tests/codegen does not)
COSTS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
    ("squared", s) for s in ("velocity", "acceleration", "jerk"))

#: tests/cuda/test_ptxas.py's float64 adjoint that spilled 8 bytes at the register cap with its
#: scaled weights in registers
WIDE = dict(difference="central", accuracy=8, dt="per_step", order=4, horizon=64,
            costs=COSTS + (("squared", "position"),))


def _measure(spec: ts.KernelSpec) -> int:
    """The criterion's measure of the adjoint's rolled column, as lowered (before any slot)."""
    return loop_live_in(driver.lowered(spec).cuda_fused_rolled("adjoint").statements)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_bench_spec_keeps_its_sums_and_weights_in_registers(dtype):
    """The bench's fused spec (bench/costs.py ``CostCase(...).fused``: position, central, H=32,
    seven terms, P written): its adjoint's loop reads fewer values defined before it than the
    threshold, so neither kernel has a slot and its source is the one without the rule."""
    spec = ts.KernelSpec(horizon=32, dof=7, dtype=dtype, costs=COSTS, outputs=("P",))
    assert _measure(spec) < CUDA_SHARED_WEIGHTS_LIVE
    source = ts.source(spec, "cuda")
    assert "TS_CGW(" not in source and "ts_cgws" not in source
    assert "double cacc0 = " in source and "const T cgw0 = " in source


def test_the_wide_float64_adjoint_keeps_its_weights_in_shared_memory():
    """The wide stencil's adjoint loop reads 32 values defined before it: in float64 its scaled
    weights are slots of shared memory (the forward keeps its sums in registers); in float32, whose
    adjoint was within the cap, they stay in registers."""
    spec = ts.KernelSpec(dof=7, dtype="float64", outputs=("P",), **WIDE)
    assert _measure(spec) >= CUDA_SHARED_WEIGHTS_LIVE
    source = ts.source(spec, "cuda")
    assert "TS_CGW(0) = " in source and "double cacc0 = " in source
    assert "TS_CGW(" not in ts.source(spec.replace(dtype="float32"), "cuda")
