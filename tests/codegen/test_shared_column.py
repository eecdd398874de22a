"""CUDA's per-column values in the thread's column of shared memory (codegen/targets.py
``cuda_shared_column``) only where a fused column's loops hold the most values: the float32 forwards
whose loop adds to the term sums many times an iteration, the float64 adjoints whose loop reads many
values defined before it. Elsewhere the sums and weights stay in registers: a row loop of one row
(the bench's position stencil) would pay a shared load and store in each term's chain on every row."""
from __future__ import annotations

import pytest

import tensorstep as ts
from tensorstep.codegen import driver
from tensorstep.codegen.shared_column import loop_adds, loop_live_in
from tensorstep.codegen.targets import CUDA_SHARED_SUMS_ADDS, CUDA_SHARED_WEIGHTS_LIVE

#: bench/costs.py's seven terms (``TERMS``; that module imports torch, which tests/codegen does not)
COSTS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
    ("squared", s) for s in ("velocity", "acceleration", "jerk"))


def _spec(dtype: str, **fields) -> ts.KernelSpec:
    fields = {"costs": COSTS, **fields}
    return ts.KernelSpec(dof=7, dtype=dtype, outputs=("P",), **fields)


#: tests/cuda/test_ptxas.py's rows that spilled at the register cap with the values in registers, and
#: the kernel that spilled
SPILLED = [
    (dict(control="bspline", degree=3, knots=64, steps=4), "float32", "forward"),
    (dict(control="bspline", degree=5, knots=64, steps=8), "float32", "forward"),
    (dict(control="bspline", degree=3, knots=64, steps=8, dt="per_trajectory"), "float32", "forward"),
    (dict(difference="central", accuracy=8, dt="per_step", order=4, horizon=64,
          costs=COSTS + (("squared", "position"),)), "float64", "adjoint"),
]
SLOTS = {"forward": "TS_CSUM(", "adjoint": "TS_CGW("}


def _measure(spec: ts.KernelSpec, kernel: str) -> int:
    """The criterion's measure of the kernel's rolled column, as lowered (before any slot)."""
    statements = driver.lowered(spec).cuda_fused_rolled(kernel).statements
    return loop_adds(statements, "cacc") if kernel == "forward" else loop_live_in(statements)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_bench_spec_keeps_its_sums_and_weights_in_registers(dtype):
    """The bench's fused spec (bench/costs.py ``CostCase(...).fused``: position, central, H=32,
    seven terms, P written): one row an iteration, 7 adds to the sums, and its adjoint's loop reads
    fewer values than the threshold: neither kernel has a slot, so its source is the one without
    the rule."""
    spec = ts.KernelSpec(horizon=32, dof=7, dtype=dtype, costs=COSTS, outputs=("P",))
    assert _measure(spec, "forward") == 7 < CUDA_SHARED_SUMS_ADDS
    assert _measure(spec, "adjoint") < CUDA_SHARED_WEIGHTS_LIVE
    source = ts.source(spec, "cuda")
    assert "TS_CSUM(" not in source and "TS_CGW(" not in source and "ts_caccs" not in source
    assert "double cacc0 = " in source and "const T cgw0 = " in source


@pytest.mark.parametrize("fields, dtype, kernel", SPILLED, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_the_columns_that_spilled_keep_their_values_in_shared_memory(fields, dtype, kernel):
    """Each spilled kernel meets the criterion (a B-spline's span of 4 or 8 rows an iteration, 7
    terms each: 28 or 56 adds; the wide stencil's adjoint loop reads 32 values defined before it)
    and its source has the slots; the other kernel of the spec has none."""
    spec = _spec(dtype, **fields)
    measure = _measure(spec, kernel)
    assert measure >= (CUDA_SHARED_SUMS_ADDS if kernel == "forward" else CUDA_SHARED_WEIGHTS_LIVE)
    source = ts.source(spec, "cuda")
    other = "adjoint" if kernel == "forward" else "forward"
    assert SLOTS[kernel] in source and SLOTS[other] not in source
