"""CUDA resource use without a GPU: every module of a grid of variants up to H=256 is compiled
with ``nvcc -cubin -arch=sm_90 --ptxas-options=-v``, and ptxas's report is checked for every
per-element kernel (one thread per column) and every once-per-call kernel (the coefficient
programs, a block per call): at most 128 registers, no spill stores, a stack frame of at most 1 KB,
at most 48 KB of static shared memory. The driver reserves a kernel's stack frame for every thread the GPU can hold, so
a large frame costs gigabytes at the first launch. How long a module takes to compile is a
benchmark figure, not a limit: ``python tests/cuda/test_ptxas.py`` prints the table (kernel, registers,
spills, stack, seconds).
"""
from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tensorstep.bench.ptxas import Kernel, Module, compile_module, nvcc, parse

NVCC = nvcc()
MAX_REGISTERS = 128
MAX_STACK = 1024
#: static shared memory a block may have
MAX_SHARED = 48 * 1024
#: a guard against a hung nvcc only (compile time is measured, never asserted)
KILL_AFTER = float(os.environ.get("PTXAS_KILL_AFTER", 600))
#: one thread per (batch, dof) column, and the once-per-call programs (the table, its tangent, the
#: dt gradient's reverse: a block, whose stack frame the driver reserves for every thread all the
#: same): the kernels the limits are for
PER_ELEMENT = ("forward", "adjoint", "dt_vjp", "dt_jvp")
ONCE_PER_CALL = ("coefficients", "coefficients_jvp", "dt_vjp_finish")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (the CUDA toolkit is not "
                                                      "installed): CUDA resource use cannot be measured")

#: the cost terms of fused specs below (bench/costs.py's)
COSTS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
    ("squared", s) for s in ("velocity", "acceleration", "jerk"))

#: (KernelSpec overrides, horizon, dtype, {part: reason it is not yet within the limits}):
#: position central and backward with per-step dt, order 4, start_index; acceleration and jerk,
#: exact and semi-implicit; float32 and float64; the longest straight-line integrator adjoints
#: (just below targets.CUDA_ROLL_ABOVE_BYTES) and horizons up to 256; a B-spline with loops over knots
GRID = [
    (dict(difference="central", dt="per_step"), 32, "float32", {}),
    (dict(difference="central", dt="per_step"), 256, "float64", {}),
    (dict(difference="backward", accuracy=2, dt="per_step", order=4, start_index=True), 64, "float32", {}),
    (dict(difference="central", start_index=True), 256, "float64", {}),
    (dict(control="acceleration", integrator="exact", start_index=True), 256, "float32", {}),
    (dict(control="acceleration", dt="per_step"), 32, "float64", {}),
    (dict(control="acceleration", dt="per_step"), 21, "float32", {}),
    (dict(control="jerk", integrator="exact", dt="per_step", order=4), 128, "float64", {}),
    (dict(control="jerk", integrator="exact", order=4), 17, "float32", {}),
    (dict(control="jerk", integrator="exact"), 10, "float64", {}),
    (dict(control="jerk"), 256, "float32", {}),
    # many rows per span (s=25): the forward and adjoint loop over each span's rows
    (dict(control="bspline", degree=4, knots=10, steps=25), 376, "float32", {}),
    (dict(control="bspline", degree=4, knots=60, steps=4), 261, "float64", {}),
    # wide per-step stencils of order 4: boundary rows that share many inputs (codegen/reads.py)
    (dict(difference="backward", accuracy=3, dt="per_step", order=4), 32, "float32", {}),
    (dict(difference="central", accuracy=8, dt="per_step", order=4), 64, "float32", {}),
    (dict(difference="central", accuracy=4, dt="per_step", order=4), 32, "float32", {}),
    # the same in float64: their boundary rows read each coefficient where they use it (volatile)
    (dict(difference="backward", accuracy=3, dt="per_step", order=4), 32, "float64", {}),
    (dict(difference="central", accuracy=8, dt="per_step", order=4), 64, "float64", {}),
    (dict(difference="central", accuracy=4, dt="per_step", order=4), 32, "float64", {}),
    # fused cost terms (bench/costs.py's seven: a bound on P, V, A, J, a squared V, A, J; P written);
    # a squared position term adds the target's gradient; an integrator's adjoint recomputes its rows
    # in segments from checkpoints kept in a local array
    (dict(costs=COSTS, outputs=("P",)), 32, "float32", {}),
    (dict(costs=COSTS, outputs=("P",)), 32, "float64", {}),
    (dict(costs=COSTS + (("squared", "position"),), outputs=("P",)), 64, "float64", {}),
    (dict(control="jerk", integrator="exact", costs=COSTS, outputs=("P",)), 32, "float64", {}),
    (dict(control="jerk", integrator="exact", costs=COSTS, outputs=("P",)), 64, "float32", {}),
    (dict(control="jerk", integrator="exact", costs=COSTS + (("squared", "position"),), outputs=("P",)), 32,
     "float64", {}),
    # past H=32 in float64: the checkpoints in the thread's local array (the stack frame)
    (dict(control="jerk", integrator="exact", costs=COSTS, outputs=("P",)), 64, "float64", {}),
    (dict(control="acceleration", costs=COSTS, outputs=("P",)), 64, "float64", {}),
    # past H=100 in float64: longer segments, so the checkpoints stay within CHECKPOINT_BYTES (1488
    # bytes of stack frame before)
    (dict(control="acceleration", integrator="exact", costs=COSTS, outputs=("P",)), 192, "float64", {}),
    # float32 checkpoints indexed from a runtime 0 (kernel.cu.j2 TS_CK): held in registers, they spilled
    # (20 bytes here, 1320 at H=192, whose float32 forward still spills)
    (dict(control="jerk", integrator="exact", order=4, costs=COSTS + (("squared", "snap"),), outputs=("P",)), 64,
     "float32", {}),
    # a recurrence's columns rolled (codegen/fused.py forward_rolled, rolled_adjoint): the float32 jerk
    # forward spilled 16 bytes straight-line, the float64 velocity adjoint with a dt per step 12, and the
    # float64 adjoints at H=256 are a reverse scan over blocks of segments (two levels of checkpoints)
    (dict(control="jerk", costs=COSTS + (("squared", "position"),), outputs=("P",)), 256, "float32", {}),
    (dict(control="velocity", dt="per_step", costs=COSTS, outputs=("P",)), 48, "float64", {}),
    (dict(control="velocity", costs=COSTS + (("squared", "position"),), outputs=("P",)), 256, "float64", {}),
    (dict(control="bspline", degree=3, knots=8, steps=4, costs=COSTS, outputs=("P",)), None, "float32", {}),
    (dict(control="bspline", degree=3, knots=8, steps=4, costs=COSTS + (("squared", "position"),),
          outputs=("P",)), None, "float64", {}),
    # wide stencils of order 4, fused: the rolled adjoint sums the start state's gradients step by step
    # (gathered at their last reader, the first steps' gradients were live together; bytes spilled before:
    # accuracy 8 with a duration per step 36, with a squared snap 132, uniform 24, per trajectory 56;
    # backward accuracy 4 with a squared snap and position 172)
    (dict(difference="central", accuracy=8, dt="per_step", order=4, costs=COSTS, outputs=("P",)), 64, "float64", {}),
    (dict(difference="central", accuracy=8, dt="per_step", order=4, costs=COSTS + (("squared", "snap"),),
          outputs=("P",)), 64, "float64", {}),
    # its scaled weights (cgw<t>) in the thread's column of shared memory (codegen/targets.py
    # cuda_shared_column; 8 bytes spilled with them in registers)
    (dict(difference="central", accuracy=8, dt="per_step", order=4, costs=COSTS + (("squared", "position"),),
          outputs=("P",)), 64, "float64", {}),
    (dict(difference="central", accuracy=8, order=4, costs=COSTS, outputs=("P",)), 64, "float64", {}),
    (dict(difference="central", accuracy=8, dt="per_trajectory", order=4, costs=COSTS, outputs=("P",)), 64,
     "float64", {}),
    (dict(difference="backward", accuracy=4, dt="per_step", order=4,
          costs=COSTS + (("squared", "snap"), ("squared", "position")), outputs=("P",)), 64, "float64", {}),
    (dict(difference="backward", accuracy=3, dt="per_step", order=4, costs=COSTS, outputs=("P",)), 64, "float64", {}),
    (dict(difference="central", accuracy=4, dt="per_step", order=4, costs=COSTS, outputs=("P",)), 64, "float64", {}),
    # fused B-splines of 64 knots (codegen/fused.py ``_span_partials``, ``_span_column_partials``,
    # ``volatile_reads``): a span's rows add to the partial sums row by row, the row weights read where
    # used (spilled before, bytes: float64 degree 3 adjoint 352 with 8 steps a span, 16 with 4; degree
    # 5 adjoint 752; float32 degree 3 forward 40)
    (dict(control="bspline", degree=3, knots=64, steps=8, costs=COSTS, outputs=("P",)), None, "float64", {}),
    (dict(control="bspline", degree=3, knots=64, steps=4, costs=COSTS, outputs=("P",)), None, "float64", {}),
    (dict(control="bspline", degree=5, knots=64, steps=8, costs=COSTS, outputs=("P",)), None, "float64", {}),
    (dict(control="bspline", degree=3, knots=64, steps=8, costs=COSTS, outputs=("P",)), None, "float32", {}),
    # float32 forwards at the 128-register cap: their first and last spans fenced every two rows
    # (codegen/targets.py CUDA_FENCED_ROWS; bytes of spill stores before, in the last spans and, degree 5,
    # across the loop: 16 and 24 with the per-dof weights read where used, 8 and 28 with them loaded first;
    # the cost sums in shared memory cleared them at 2.5 times the row's cycles by the SASS model)
    (dict(control="bspline", degree=3, knots=64, steps=4, costs=COSTS, outputs=("P",)), None, "float32", {}),
    (dict(control="bspline", degree=5, knots=64, steps=8, costs=COSTS, outputs=("P",)), None, "float32", {}),
    # fused forwards read the inputs they use only at their end where they first use them (codegen/fused.py
    # ``inputs_where_used``: each term's per-dof weight, a goal's state after the knots' loop); loaded first,
    # at the cap: an order-4 float32 B-spline of six terms, two outputs, spilled 16 bytes, a float64
    # one-sided stencil at H=200 with eight terms and start_index 8
    (dict(control="bspline", degree=5, knots=32, steps=2, order=4, outputs=("P", "A"),
          costs=(("bound", "position"), ("bound", "velocity"), ("bound", "jerk"), ("bound", "snap"),
                 ("squared", "acceleration"), ("squared", "jerk"))), None, "float32", {}),
    (dict(difference="central", accuracy=(4, 4, 2), end="one_sided", dt="per_step", start_index=True, layout="bdh",
          outputs=("V",), costs=COSTS[:4] + tuple(("squared", s) for s in ("position", "velocity", "acceleration",
                                                                              "jerk"))), 200, "float64", {}),
    # a float64 order-4 B-spline adjoint with a goal, nine terms and row tiles (layout "bdh"): 168 bytes
    # spilled, the tiles' store values hoisted out of the knots' loop and the start state's and goal's
    # sums kept as a chain and a total; the store reading its lane where it runs and the sums added row
    # by row leave 40 (the tile's n and lanes, addresses live across the loop); the store reading the
    # warp's n and first column where it runs, 24; the dt powers kept as computed (not again from
    # dt, which stayed live), none
    (dict(control="bspline", degree=4, knots=8, steps=2, end="goal", dt="per_trajectory", order=4, layout="bdh",
          outputs=(), costs=tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk", "snap"))
          + tuple(("squared", s) for s in ("position", "acceleration", "jerk", "snap"))), None, "float64",
     {}),
    # a float64 order-4 B-spline adjoint with a goal and ten terms, layout "bhd": 4 bytes spilled, the
    # goal's row (64-bit) held through the knots' loop; none with the column's bases worked out again
    # after it (codegen/column_again.py)
    (dict(control="bspline", degree=5, knots=32, steps=4, end="goal", dt="per_trajectory", order=4, outputs=(),
          costs=tuple((k, s) for k in ("bound", "squared") for s in ("position", "velocity", "acceleration", "jerk",
                                                                      "snap"))), None, "float64", {}),
    # a dt per trajectory: each thread computes its coefficients, monomials of its dt, the factors read
    # where they are used from the block's copy in shared memory (104 and 244 bytes spilled before)
    (dict(control="bspline", degree=4, knots=6, steps=2, dt="per_trajectory", costs=COSTS, outputs=("P",)), None,
     "float64", {}),
    # the same in float32, the bench's position step: the factors copied as float, each coefficient a
    # float product of the factor and the thread's power rounded to float (forward: 8 bytes spilled before)
    (dict(dt="per_trajectory", costs=COSTS, outputs=("P",)), 32, "float32", {}),
    # fused B-splines with a dt per trajectory and many knots: the block's copy holds the factors the
    # columns read, the first slot of each distinct value (codegen/render.py ``factors_read``: degree 3,
    # 8 steps a span, 290 of the table's 12,186 slots), where the whole table was too large to copy and
    # the factors stayed constants (spilled before, bytes forward / adjoint: degree 3, 8 steps 1,908 /
    # 3,124; 4 steps 280 / 1,116; degree 5, 8 steps 6,572 / 9,584; float32 degree 3, 8 steps 332 / 504)
    (dict(control="bspline", degree=3, knots=64, steps=8, dt="per_trajectory", costs=COSTS, outputs=("P",)), None,
     "float64", {}),
    (dict(control="bspline", degree=3, knots=64, steps=4, dt="per_trajectory", costs=COSTS, outputs=("P",)), None,
     "float64", {}),
    (dict(control="bspline", degree=5, knots=64, steps=8, dt="per_trajectory", costs=COSTS, outputs=("P",)), None,
     "float64", {}),
    # (float32 forward: 8 bytes before its spans were fenced, 32 with the weights loaded first, 332 before
    # the copy of the factors read; adjoint 504 before the copy)
    (dict(control="bspline", degree=3, knots=64, steps=8, dt="per_trajectory", costs=COSTS, outputs=("P",)), None,
     "float32", {}),
    # unfused, a dt per trajectory: the adjoint, dt_jvp and dt_vjp read the factors where they use them
    # from the block's copy, float64's dt_jvp its coefficients' powers from the thread's column in
    # shared memory, float32's dt_vjp the factors only (spilled before, bytes: B-spline degree 3 dt_jvp
    # 44; degree 5, 64 knots dt_jvp 32, dt_vjp 136; accuracy 8 order 4 adjoint 192, dt_jvp 856, dt_vjp
    # 456; backward accuracy 3 order 4 dt_vjp 292, in float32 264); with 4 steps a span the degree-5
    # B-spline was and stays within
    (dict(control="bspline", degree=3, knots=32, steps=4, dt="per_trajectory"), None, "float64", {}),
    (dict(control="bspline", degree=5, knots=64, steps=1, dt="per_trajectory"), None, "float64", {}),
    (dict(control="bspline", degree=5, knots=64, steps=4, dt="per_trajectory"), None, "float64", {}),
    (dict(difference="central", accuracy=8, order=4, dt="per_trajectory"), 128, "float64", {}),
    (dict(difference="backward", accuracy=3, order=4, dt="per_trajectory"), 64, "float64", {}),
    # B-spline adjoints with 2 rows a span: a run of stores after the knots' loop loads the output
    # gradients it reads again rather than read the locals loaded before the loop, which kept them live
    # through it (codegen/reads.py; bytes spilled before: per trajectory, degree 4 8, 204 with the
    # factors as constants, degree 5 196; uniform, degree 4 28)
    (dict(control="bspline", degree=4, knots=32, steps=2, dt="per_trajectory"), None, "float64", {}),
    (dict(control="bspline", degree=5, knots=32, steps=2, dt="per_trajectory"), None, "float64", {}),
    (dict(control="bspline", degree=4, knots=32, steps=2), None, "float64", {}),
    (dict(control="bspline", degree=4, knots=32, steps=2, dt="per_trajectory"), None, "float32", {}),  # 8 before
    # and a float64 B-spline's forward and adjoint read their coefficients where used in the straight-line
    # spans (codegen/targets.py cuda_volatile_coefficients; uniform, degree 5: 96 and 172 bytes before)
    (dict(control="bspline", degree=5, knots=32, steps=2), None, "float64", {}),
    # float32's forward too (24 bytes before); its adjoint fits with them in registers
    (dict(control="bspline", degree=5, knots=32, steps=2), None, "float32", {}),
    # float32's adjoint and dt_jvp: float products of the factors and the thread's powers rounded to
    # float (codegen/targets.py cuda_float_powers), dt_jvp's row loops unrolled by 2 (spilled before,
    # bytes: dt_jvp 12 and 8 here; B-spline (degree, knots, steps) (3,64,2) dt_jvp 12, (5,64,1) 8,
    # (5,64,4) 4; (5,32,2) adjoint 4; central accuracy 8 order 4 H=128 dt_jvp 60)
    (dict(difference="backward", accuracy=3, order=4, dt="per_trajectory"), 64, "float32", {}),
    (dict(dt="per_trajectory"), 200, "float32", {}),
    (dict(control="bspline", degree=3, knots=64, steps=2, dt="per_trajectory"), None, "float32", {}),
    (dict(control="bspline", degree=5, knots=64, steps=4, dt="per_trajectory"), None, "float32", {}),
    (dict(control="bspline", degree=5, knots=32, steps=2, dt="per_trajectory"), None, "float32", {}),
    (dict(difference="central", accuracy=8, order=4, dt="per_trajectory"), 128, "float32", {}),
    # from the seeded survey of fused specs (``--survey 40 2026``): its one spill, a rolled B-spline adjoint
    # (4 bytes before its spans' partial sums were added row by row), and clean ones (the largest stack
    # frame, 760 bytes; the most registers, 126; a dt per step, exact)
    (dict(control="bspline", degree=3, knots=32, steps=4, order=4, dt="per_trajectory",
          costs=(("bound", "acceleration"), ("bound", "jerk")), outputs=("S",)), None, "float64", {}),
    (dict(control="jerk", dt="per_trajectory", outputs=("P", "J"),
          costs=(("bound", "jerk"), ("squared", "acceleration"), ("squared", "position"))), 256, "float32", {}),
    (dict(control="velocity", dt="per_step", outputs=("V",),
          costs=COSTS[:3] + (("squared", "velocity"), ("squared", "jerk"), ("squared", "position"))), 8, "float64", {}),
    (dict(control="velocity", integrator="exact", dt="per_step", outputs=("V",),
          costs=COSTS[:4] + (("squared", "velocity"), ("squared", "jerk"))), 100, "float64", {}),
    (dict(dt="per_trajectory", costs=COSTS[1:4] + (("squared", "acceleration"), ("squared", "position")),
          outputs=("P",)), 64, "float32", {}),
    # layout "bdh" above a warp's whole rows with the cost alone written: the forward stages no rows (its
    # tile array had no element: nvcc failed)
    (dict(control="jerk", dt="per_step", layout="bdh", costs=(("squared", "position"),), outputs=()), 100, "float64",
     {}),
    # layout "bdh" above a warp's whole rows: row tiles of a sector's rows, 32 rows (the adjoint's
    # N = H - 1, an unaligned horizon) and 16 (float64 order 4, unaligned); straight-line and loops
    (dict(difference="central", layout="bdh"), 128, "float32", {}),
    (dict(difference="backward", accuracy=2, layout="bdh"), 64, "float64", {}),
    (dict(control="acceleration", layout="bdh"), 70, "float32", {}),
    (dict(control="jerk", integrator="exact", dt="per_step", order=4, layout="bdh"), 70, "float64", {}),
    (dict(control="bspline", degree=4, knots=16, steps=8, layout="bdh"), None, "float32", {}),
    # float64 order-4 recurrences: their reverse scan's checkpoints only the values a recomputed segment reads,
    # the action read again, the two levels' whole array within the budget (stack frame before: 6,304, 4,000 B)
    (dict(control="velocity", dt="per_step", order=4, outputs=("V",),
          costs=(("bound", "acceleration"), ("squared", "acceleration"))), 200, "float64", {}),
    (dict(control="velocity", integrator="exact", dt="per_step", layout="bdh", order=4, outputs=("J", "S"),
          costs=(("squared", "jerk"),)), 128, "float64", {}),
]
DOF = 7


def spec_of(overrides: dict, horizon: int | None, dtype: str):
    """``horizon`` None: the one a B-spline's knots and steps give."""
    import tensorstep as ts

    return ts.KernelSpec(horizon=horizon, dof=DOF, dtype=dtype, **overrides)


def cases() -> list[tuple[str, dict, int, str, str, str]]:
    """(label, overrides, horizon, dtype, part, reason not yet within the limits or '') for every
    module of the grid: each library the spec has kernels in, as the runtime builds them (a fused
    spec has no dt libraries of its own)."""
    from tensorstep.codegen import abi
    from tensorstep.codegen.arguments import table

    return [(f"{spec.name}-{part}", overrides, horizon, dtype, part, not_yet.get(part, ""))
            for overrides, horizon, dtype, not_yet in GRID
            for spec in [spec_of(overrides, horizon, dtype)]
            for part in abi.LIBRARIES if abi.part_kernels(part, table(spec))]


def source_of(overrides: dict, horizon: int, dtype: str, part: str) -> str:
    from tensorstep.bench.ptxas import source_of

    return source_of(spec_of(overrides, horizon, dtype), part)


def compile_all(selected: list[tuple], workers: int = 0) -> dict[str, Module]:
    """Render the selected modules in worker processes (SymPy is CPU-bound) and compile each as soon
    as it is rendered (nvcc runs in subprocesses), ``workers`` of each at a time."""
    workdir = Path(tempfile.mkdtemp(prefix="tensorstep-ptxas-"))
    workers = workers or max(1, os.cpu_count() or 1)
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold torch's threads
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as renderers, \
                concurrent.futures.ThreadPoolExecutor(workers) as compilers:
            rendering = {renderers.submit(source_of, o, h, dt, part): label for label, o, h, dt, part, _ in selected}
            compile_one = functools.partial(compile_module, kill_after=KILL_AFTER)
            compiling = [compilers.submit(compile_one, rendering[done], done.result(), workdir)
                         for done in concurrent.futures.as_completed(rendering)]
            modules = [c.result() for c in compiling]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    order = [case[0] for case in selected]
    return {m.label: m for m in sorted(modules, key=lambda m: order.index(m.label))}


def per_element(kernel: str) -> bool:
    return kernel.rsplit("_", 1)[-1] in ("forward", "adjoint") or kernel.endswith(("_dt_vjp", "_dt_jvp"))


def once_per_call(kernel: str) -> bool:
    return kernel.endswith(tuple(f"_{k}" for k in ONCE_PER_CALL))


def _param(case: tuple) -> object:
    label, reason = case[0], case[-1]
    marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
    return pytest.param(case, id=label, marks=marks)


@pytest.fixture(scope="module")
def compiled() -> dict[str, Module]:
    modules = compile_all(cases())
    if os.environ.get("TENSORSTEP_PTXAS_TABLE"):  # where to write the table (as in
        # docs/benchmarks-history.md, sixth session's CUDA resource use)
        Path(os.environ["TENSORSTEP_PTXAS_TABLE"]).write_text(table(modules) + "\n")
    return modules


@pytest.mark.parametrize("case", [_param(c) for c in cases()])
def test_module_stays_within_cuda_limits(compiled, case):
    module = compiled[case[0]]
    assert not module.error, f"{module.label}: nvcc failed: {module.error}"
    assert any(per_element(k.name) for k in module.kernels), f"{module.label}: no per-element kernel in the ptxas report"
    checked = [k for k in module.kernels if per_element(k.name) or once_per_call(k.name)]
    for k in checked:
        assert k.registers <= MAX_REGISTERS, f"{k.name}: {k.registers} registers > {MAX_REGISTERS}"
        assert k.spill_stores == 0, f"{k.name}: {k.spill_stores} bytes of spill stores"
        assert k.stack <= MAX_STACK, f"{k.name}: {k.stack} bytes stack frame > {MAX_STACK}"
        assert k.shared <= MAX_SHARED, f"{k.name}: {k.shared} bytes of static shared memory > {MAX_SHARED}"


def test_parse_reads_a_ptxas_report():
    report = """ptxas info    : Compiling entry function 'ts_x_forward' for 'sm_90'
ptxas info    : Function properties for ts_x_forward
    64 bytes stack frame, 44 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 64 bytes cumulative stack size, 1848 bytes smem
"""
    assert parse(report) == [Kernel("ts_x_forward", 255, 44, 64, 1848)]


def table(modules: dict[str, Module]) -> str:
    """A Markdown table of every kernel of the modules."""
    rows = ["| module | s | kernel | registers | spill stores (B) | stack (B) |", "|---|---:|---|---:|---:|---:|"]
    for m in modules.values():
        if m.error:
            rows.append(f"| {m.label} | {m.seconds:.1f} | {m.error.splitlines()[0]} | | | |")
        for k in m.kernels:
            kernel = k.name.split("_o3_")[-1].split("_o4_")[-1]
            rows.append(f"| {m.label} | {m.seconds:.1f} | {kernel} | {k.registers} | {k.spill_stores} | {k.stack} |")
    return "\n".join(rows)


#: the survey's draws (``survey``): fused specs beyond the grid
SURVEY_HORIZONS = (8, 17, 32, 64, 100, 256)
SURVEY_CONTROLS = ("position", "velocity", "acceleration", "jerk", "bspline")


def survey_overrides(rng: random.Random) -> tuple[dict, int | None, str]:
    """One fused spec drawn at random: control, dtype, order, dt mode, horizon (a B-spline's from
    its degree, knots and steps), a non-empty subset of the cost terms the order allows (a squared
    position term in about half) and a subset of the outputs (possibly none)."""
    from tensorstep.codegen.spec import BSPLINE_DT, DERIVATIVE_NAMES, OUTPUT_NAMES

    control = rng.choice(SURVEY_CONTROLS)
    dtype, order = rng.choice(("float32", "float64")), rng.choice((3, 4))
    overrides: dict = dict(control=control, order=order)
    horizon: int | None = rng.choice(SURVEY_HORIZONS)
    if control == "bspline":
        overrides.update(degree=rng.choice((3, 4, 5)), knots=rng.choice((8, 16, 32)), steps=rng.choice((1, 2, 4)),
                         dt=rng.choice(BSPLINE_DT))
        horizon = None
    else:
        overrides["dt"] = rng.choice(("uniform", "per_step", "per_trajectory"))
        if control == "position":
            overrides["difference"] = rng.choice(("central", "backward"))
        else:
            overrides["integrator"] = rng.choice(("semi_implicit_euler", "exact"))
    terms = [(k, s) for k in ("bound", "squared") for s in DERIVATIVE_NAMES[: order + 1]]
    costs = [t for t in terms if t != ("squared", "position") and rng.random() < 0.4]
    if rng.random() < 0.5:
        costs.append(("squared", "position"))
    overrides["costs"] = tuple(costs or [rng.choice(terms)])
    overrides["outputs"] = tuple(o for o in OUTPUT_NAMES[: order + 1] if rng.random() < 0.3)
    return overrides, horizon, dtype


def survey(n: int, seed: int) -> list[tuple[str, dict, int | None, str, str, str]]:
    """``n`` fused specs drawn with ``seed`` (redrawn where the spec is invalid), as ``cases()``
    gives them: a case per library with kernels."""
    from tensorstep.codegen import abi
    from tensorstep.codegen.arguments import table as argument_table

    rng, drawn = random.Random(seed), []
    while len(drawn) < n:
        overrides, horizon, dtype = survey_overrides(rng)
        try:
            spec = spec_of(overrides, horizon, dtype)
        except ValueError:
            continue
        drawn += [(f"{spec.name}-{part}", overrides, horizon, dtype, part, "")
                  for part in abi.LIBRARIES if abi.part_kernels(part, argument_table(spec))]
    return drawn


def compile_timed(label: str, source: str, workdir: Path) -> tuple[list[Kernel], float, str]:
    """nvcc -cubin of one module: ptxas's kernels, the CPU seconds of nvcc and the compilers it ran
    (user + system), and nvcc's output where it failed."""
    path = workdir / f"{label}.cu"
    path.write_text(source)
    cmd = [NVCC or "nvcc", "-cubin", "-arch=sm_90", "--ptxas-options=-v", str(path),
           "-o", str(path.with_suffix(".cubin"))]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        report = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)  # reaped here: its rusage, compilers included
        process.returncode = os.waitstatus_to_exitcode(status)
    return parse(report), usage.ru_utime + usage.ru_stime, report[-2000:] if process.returncode else ""


def survey_table(selected: list[tuple], workers: int = 2) -> str:
    """Render the selected modules in ``workers`` processes, compile them one at a time (so that the
    CPU seconds are each nvcc's own), and give the per-element kernels' table."""
    rows = ["| spec | kernel | registers | spill stores (B) | stack (B) | nvcc CPU s |",
            "|---|---|---:|---:|---:|---:|"]
    workdir = Path(tempfile.mkdtemp(prefix="tensorstep-survey-"))
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as renderers:
            rendering = [renderers.submit(source_of, o, h, dt, part) for _, o, h, dt, part, _ in selected]
            for case, source in zip(selected, rendering):
                kernels, seconds, error = compile_timed(case[0], source.result(), workdir)
                if error:
                    rows.append(f"| {case[0]} | nvcc failed: {error.splitlines()[0]} | | | | {seconds:.1f} |")
                name = case[0].rsplit("-", 1)[0]  # the spec's name: each kernel's is name_kernel
                for k in kernels:
                    if per_element(k.name):
                        kernel = k.name[len(name) + 1:]
                        rows.append(f"| {case[0]} | {kernel} | {k.registers} | {k.spill_stores} | {k.stack} "
                                    f"| {seconds:.1f} |")
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join(rows)


if __name__ == "__main__":
    # python tests/cuda/test_ptxas.py [label substrings]: the grid's table;
    # python tests/cuda/test_ptxas.py --survey N SEED: N fused specs drawn with SEED, their table
    if sys.argv[1:2] == ["--survey"]:
        print(survey_table(survey(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        wanted = sys.argv[1:]
        chosen = [c for c in cases() if not wanted or any(w in c[0] for w in wanted)]
        print(table(compile_all(chosen)))
