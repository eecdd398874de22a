"""Each per-element CUDA kernel's ``__launch_bounds__``: the resident blocks the launch plan's rule
gives it (codegen/targets.py ``cuda_min_blocks``, ``CUDA_MORE_BLOCKS``) are those its generated
source asks for, and ptxas (sm_90) keeps a seeded sample of the kernels the rule gives more blocks
within the lower register cap, with no spill."""
from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path

import pytest

import tensorstep as ts
from tensorstep.bench import launch_bounds, ptxas
from tensorstep.codegen import targets
from tensorstep.codegen.driver import generate
from tensorstep.codegen.targets import CUDA_BLOCK, CUDA_SM_REGISTERS

#: bench/costs.py's seven terms: a bound on P, V, A, J and a squared V, A, J
COSTS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
    ("squared", s) for s in ("velocity", "acceleration", "jerk"))
PER_ELEMENT = ("forward", "adjoint", "dt_vjp", "dt_jvp")

#: (spec fields, the forward's and the adjoint's resident blocks): a fused float32 row-loop forward
#: whose cost terms x rows of its loop's body x states (order + 1) are at most 28 (the costs bench's)
#: asks for 3, and so do a float32 row-loop adjoint and a float64 row-loop forward of at most 10; the
#: bench's own adjoint and float64 forward (28), float64 adjoints, B-splines, the unfused kernels and
#: larger ones keep 2
CASES = [
    (dict(horizon=32, costs=COSTS, outputs=("P",)), 3, 2),  # the costs bench's step: 7 x 1 x 4
    (dict(horizon=32, costs=COSTS, outputs=("P",), dtype="float64"), 2, 2),
    (dict(horizon=64, control="jerk", integrator="exact", costs=COSTS, outputs=()), 3, 2),
    (dict(horizon=64, control="jerk", integrator="exact", costs=COSTS + (("squared", "position"),), outputs=()), 2, 2),
    (dict(horizon=64, order=4, costs=COSTS, outputs=("P",)), 2, 2),  # 7 x 1 x 5
    (dict(horizon=48, order=4, costs=COSTS[5:], outputs=("P",)), 3, 3),  # 2 x 1 x 5
    (dict(horizon=48, order=4, costs=COSTS[5:], outputs=("P",), dtype="float64"), 3, 2),
    (dict(horizon=48, costs=COSTS[4:], outputs=("P",), dtype="float64"), 2, 2),  # 3 x 1 x 4
    (dict(control="bspline", degree=7, knots=8, steps=1, costs=COSTS[:4], outputs=("P",)), 2, 2),  # 4 x 1 x 4
    (dict(control="bspline", degree=3, knots=8, steps=1, costs=COSTS[:5], outputs=("P",)), 2, 2),  # 5 x 1 x 4
    (dict(control="bspline", degree=3, knots=8, steps=2, costs=COSTS[:2], outputs=("P",)), 2, 2),  # 2 x 2 x 4
    (dict(control="bspline", degree=5, knots=8, steps=4, costs=(("squared", "velocity"),), outputs=("P",)), 2, 2),
    (dict(control="bspline", degree=3, knots=8, steps=4, costs=COSTS[:2], outputs=("P",)), 2, 2),  # 2 x 4 x 4
    (dict(horizon=32, dt="per_step"), 2, 2),  # unfused
]


def _bounds(source: str, name: str, kernel: str) -> tuple[int, int]:
    found = re.search(rf"__global__ __launch_bounds__\((\d+), (\d+)\) void {name}_{kernel}\(", source)
    assert found, kernel
    return int(found[1]), int(found[2])


@pytest.mark.parametrize("fields,forward,adjoint", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_each_kernels_bounds_are_the_plans(fields, forward, adjoint):
    """The source's bounds per kernel are the plan's (``CudaLaunchPlan.min_blocks``), the plan
    rebuilt from the build's metadata gives the same, and the rule gives the forward ``forward``
    blocks, the adjoint ``adjoint`` (a cap of 85 registers at 3: ptxas takes 80) and every other
    kernel 2 (128)."""
    spec = ts.KernelSpec(dof=7, **fields)
    generated = generate(spec, targets=("cuda",))
    source, plan = generated.source("cuda"), generated.launch_plan("cuda")
    assert plan == targets.CUDA.launch_plan(spec, generated.metadata)
    kernels = [k for k in PER_ELEMENT if f" void {spec.name}_{k}(" in source]
    assert "forward" in kernels and "adjoint" in kernels
    for kernel in kernels:
        threads, blocks = _bounds(source, spec.name, kernel)
        assert threads == CUDA_BLOCK and blocks == plan.min_blocks(kernel)
        assert blocks == {"forward": forward, "adjoint": adjoint}.get(kernel, 2), kernel
        assert CUDA_SM_REGISTERS // (threads * blocks) == {2: 128, 3: 85}[blocks]


def test_dt_vjp_keeps_its_grid():
    """dt_vjp's grid of at most 132 x its resident blocks (2), whatever the forward asks for."""
    spec = ts.KernelSpec(horizon=32, dof=7, dt="per_step")
    plan = generate(spec, targets=("cuda",)).launch_plan("cuda")
    assert plan.min_blocks("dt_vjp") == 2 and plan.dt_vjp_grid(40000) == 264


def test_the_rule_is_data(monkeypatch):
    """A rule added to CUDA_MORE_BLOCKS (the float64 adjoint at 4 blocks) is what the source asks for."""
    spec = ts.KernelSpec(horizon=32, dof=7, dtype="float64", costs=COSTS, outputs=("P",))
    monkeypatch.setattr(targets, "CUDA_MORE_BLOCKS", (("float64", "adjoint", "rows", 28, 4),))
    source = generate(spec, targets=("cuda",)).source("cuda")
    assert _bounds(source, spec.name, "adjoint") == (256, 4) and _bounds(source, spec.name, "forward") == (256, 2)


def test_with_min_blocks_sets_the_named_kernels_only():
    spec = ts.KernelSpec(horizon=16, dof=3, costs=COSTS, outputs=("P",), dtype="float64")
    source = ptxas.source_of(spec, "core")
    patched = launch_bounds.with_min_blocks(source, ("adjoint",), 4)
    assert _bounds(patched, spec.name, "adjoint") == (256, 4) and _bounds(patched, spec.name, "forward") == (256, 2)
    assert patched.replace("(256, 4) void", "(256, 2) void") == source
    with pytest.raises(ValueError):
        launch_bounds.with_min_blocks(source, ("dt_jvp",), 3)


def test_blocks_an_sm_holds_by_registers():
    """65,536 registers, allocated 256 a warp: 128 and 95 registers hold 2 blocks of 256, 80 hold 3,
    64 hold 4; shared memory limits too (228 KB, 1 KB reserved a block)."""
    assert [launch_bounds.sm_blocks(r, 0) for r in (128, 111, 95, 80, 64, 32)] == [2, 2, 2, 3, 4, 8]
    assert launch_bounds.sm_blocks(32, 48 * 1024) == 4


def test_the_draws_cover_the_fields_and_where_keeps_what_the_rule_reads():
    drawn = launch_bounds.specs(60, 3)
    for field, values in (("dtype", {"float32", "float64"}), ("layout", {"bhd", "bdh"}), ("order", {3, 4}),
                          ("control", {"position", "velocity", "acceleration", "jerk", "bspline"}),
                          ("dt", {"uniform", "per_step", "per_trajectory"})):
        assert {getattr(s, field) for s in drawn} == values, field
    assert all(s.costs for s in drawn) and all(16 <= s.horizon <= 256 for s in drawn)
    kept = launch_bounds.specs(4, 3, where={"dtype": "float32", "kind": "spans", "row_terms": "16"})
    assert all(s.dtype == "float32" and s.control == "bspline" for s in kept)
    assert all(targets.cuda_row_terms(len(s.costs), s.steps, s.order) == 16 for s in kept)
    either = launch_bounds.specs(12, 3, where={"control": "velocity|jerk"})  # (bench/frames.py's survey)
    assert {s.control for s in either} == {"velocity", "jerk"}


def test_the_frames_table_lists_the_kernels_above_the_limits():
    from tensorstep.bench import frames

    spec = ts.KernelSpec(horizon=200, dof=7, control="velocity", dt="per_step", dtype="float64", order=4,
                         costs=(("squared", "acceleration"),), outputs=("V",))
    rows = [frames.Row(spec.name, "forward", 64, 0, 0, 0.5), frames.Row(spec.name, "adjoint", 68, 0, 6304, 0.5),
            frames.Row(spec.name, "dt_vjp", 129, 8, 1024, 0.5)]
    assert [r.above() for r in rows] == [[], ["stack"], ["registers", "spills"]]
    lines = frames.table(rows, [spec])
    assert [line.split(" | ")[5:] for line in lines[2:4]] == [["adjoint", "68", "0", "6304", "stack |"],
                                                               ["dt_vjp", "129", "8", "1024", "registers, spills |"]]
    assert lines[-1].startswith("\n1 specs, 3 per-element kernels, 2 above the limits; largest stack 6304 B")


def test_the_table_by_size_counts_the_spills_at_each_n():
    spec = ts.KernelSpec(horizon=32, dof=7, costs=COSTS, outputs=("P",))
    Row = launch_bounds.Row
    rows = [Row(spec.name, "forward", 2, 111, 0, 0, 2), Row(spec.name, "forward", 3, 80, 12, 16, 3),
            Row(spec.name, "adjoint", 2, 95, 0, 0, 2), Row(spec.name, "adjoint", 3, 80, 0, 0, 3)]
    lines = launch_bounds.by_size(rows, [spec])
    assert lines[2:] == ["| float32 | adjoint | rows | 28 | 1 | 0 | 0 | 2 |",
                         "| float32 | forward | rows | 28 | 1 | 0 | 1 (12) | 3 |"]


#: the seeded sample of fused specs (bench/launch_bounds.py's draws) with a kernel each rule of
#: CUDA_MORE_BLOCKS gives 3 blocks, SAMPLE a rule, compiled by ptxas
SAMPLE, SEED = 2, 11


def _selected() -> list:
    drawn = launch_bounds.specs(300, SEED, where={"kind": "rows"})
    picked = []
    for dtype, kernel, *_ in targets.CUDA_MORE_BLOCKS:
        given = [s for s in drawn if s.dtype == dtype and targets.CUDA.min_blocks(s).get(kernel, 2) > 2]
        picked += [(spec, kernel) for spec in given[:SAMPLE]]
    return picked


SELECTED = _selected()


@functools.lru_cache(maxsize=None)
def _compiled(spec: ts.KernelSpec) -> ptxas.Module:
    """The spec's core module compiled once (a spec may be sampled for two kernels)."""
    with tempfile.TemporaryDirectory() as workdir:
        return ptxas.compile_module(spec.name, ptxas.source_of(spec, "core"), Path(workdir))


def test_the_sample_covers_every_rule():
    assert len(SELECTED) == SAMPLE * len(targets.CUDA_MORE_BLOCKS)


@pytest.mark.skipif(ptxas.nvcc() is None, reason="nvcc not found on PATH: CUDA resource use cannot be measured")
@pytest.mark.parametrize("spec,kernel", SELECTED, ids=lambda x: x if isinstance(x, str) else x.name)
def test_the_kernels_given_more_blocks_do_not_spill(spec, kernel):
    """ptxas keeps each kernel the rule gives 3 blocks (float32 forwards and adjoints, float64
    forwards) within 80 registers with no spill store."""
    module = _compiled(spec)
    assert not module.error, module.error
    (found,) = [k for k in module.kernels if k.name == f"{spec.name}_{kernel}"]
    assert found.registers <= CUDA_SM_REGISTERS // (CUDA_BLOCK * 3) and found.spill_stores == 0, found
