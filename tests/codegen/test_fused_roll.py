"""Fused columns with their interior rows rolled into loops (codegen/fused.py, codegen/roll.py).

A cost term at a row-relative row (``CostTerms.value_at``, ``slope_at``) is one node at every row,
and placed at a row it is the term ``value`` and ``slope`` build there."""
from __future__ import annotations

import dataclasses
import re

import pytest
import sympy as sp

import tensorstep as ts
from tensorstep.bench.ptxas import source_of
from tensorstep.codegen import fused, roll
from tensorstep.codegen.arguments import table
from tensorstep.codegen.lower import lower
from tensorstep.codegen.printer import COLUMN
from tensorstep.codegen.builders import build_operator
from tensorstep.codegen.statements import For, Rel, place
from tensorstep.codegen.targets import C, CUDA
from sweep import sample

TERMS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + (
    ("squared", "position"), ("squared", "velocity"), ("squared", "jerk"))


def _spec(**fields) -> ts.KernelSpec:
    fields = {"horizon": 12, "costs": TERMS, **fields}
    return ts.KernelSpec(dof=2, outputs=("P",), **fields)


def _parsed(node) -> sp.Expr:
    """A printed expression read back by SymPy (macro reads as symbols)."""
    text = COLUMN.expr(node)
    for name in sorted(set(re.findall(r"[A-Z]+\d*\(\d+\)", text)), key=len, reverse=True):
        text = text.replace(name, name.replace("(", "_").replace(")", ""))
    return sp.sympify(text.replace("TS_MAX", "Max").replace("TS_MIN", "Min"))


def test_a_term_at_a_relative_row_is_one_node_and_placed_is_the_term_at_that_row():
    spec = _spec()  # squared position: its target's slope too
    for wrt in (fused.kinds.Y, fused.kinds.TARGET):
        for narrow in (False, True):
            for unit in (False, True):
                terms = fused.CostTerms(table(spec), narrow, unit)
                for t, kind, k in [x for x in terms.terms if wrt is fused.kinds.Y or x[1] == "squared"]:
                    assert terms.value_at(t, kind, k, Rel(0)) == terms.value_at(t, kind, k, Rel(0))
                    assert terms.slope_at(t, kind, k, Rel(-2), wrt) == terms.slope_at(t, kind, k, Rel(-2), wrt)
                    for h in (1, 5):
                        at = place(terms.value_at(t, kind, k, Rel(0)), h)
                        assert sp.simplify(_parsed(at) - _parsed(terms.value(t, kind, k, h))) == 0
                        at = place(terms.slope_at(t, kind, k, Rel(1), wrt, prefix="yr"), h - 1)
                        assert sp.simplify(_parsed(at) - _parsed(terms.slope(t, kind, k, h, wrt, prefix="yr"))) == 0


#: position control's boundary options and stencils, each with its interior steps rolled
ROLLED = {
    "central": dict(),
    "backward": dict(difference="backward", accuracy=2),
    "goal": dict(end="goal"),
    "one_sided": dict(end="one_sided"),
    "per_step": dict(dt="per_step"),
    "snap": dict(order=4, accuracy=(2, 2, 2, 2)),
    "indexed_bdh_target": dict(start_index=True, layout="bdh", costs=TERMS[:4] + (("squared", "position"),)),
}


# a seeded three of the seven: every boundary option's interior steps are the one loop the rolled form
# builds (each option's rolled columns run against the definitions in tests/kernels/test_costs.py)
@pytest.mark.parametrize("case", sample(ROLLED, 3, seed=6))
def test_a_fused_stencils_cuda_columns_are_as_long_at_any_horizon(case):
    """CUDA's fused forward and adjoint of a stencil: one loop each, the same statements at H=72 and
    H=256; the whole core module's source within a few lines (layout bdh stages row tiles past 32
    rows at both)."""
    lengths, sources = [], []
    for horizon in (72, 256):
        spec = _spec(horizon=horizon, **ROLLED[case])
        codes = CUDA.codes(lower(build_operator(spec), table(spec)), ("forward", "adjoint"), 8)
        assert [sum(isinstance(s, For) for s in codes[k].statements) for k in ("forward", "adjoint")] == [1, 1]
        lengths.append([len(codes[k].body) for k in ("forward", "adjoint")])
        sources.append(len(source_of(spec, "core").splitlines()))
    assert lengths[0] == lengths[1]
    assert abs(sources[1] - sources[0]) <= 4, sources


def test_c_keeps_to_its_threshold_straight_line_fused_columns():
    """C's fused stencil columns stay straight-line, as tuned, up to fused.C_ROLL_ABOVE_H rows, and are
    rolled past it (every form): the adjoint one loop, the float32 forward a loop over its float runs
    (``_float_run_loops``) and one over the steps after the last run's end (the boundary steps
    follow straight-line)."""
    for horizon, loops in ((fused.C_ROLL_ABOVE_H, (0, 0)), (fused.C_ROLL_ABOVE_H + 1, (2, 1))):
        spec = _spec(horizon=horizon)
        code = lower(build_operator(spec), table(spec))
        kernels = ("forward", "adjoint")
        variants = [C.codes(code, kernels, 4)] + list(C.form_codes(code, kernels, 4).values())
        assert len(variants) == 4  # the general form, narrow, unit rows, both
        for codes in variants:
            assert tuple(sum(isinstance(s, For) for s in codes[k].statements) for k in kernels) == loops


def _float_run_loops(statements: list) -> list[For]:
    """The loops over float runs of a rolled forward (codegen/roll.py ``_cut``): over ``rs``, by
    fused.FLOAT_RUN_ROWS steps."""
    return [s for s in statements if isinstance(s, For) and s.var == "rs"]


@pytest.mark.parametrize("control", ["position", "velocity", "jerk"])
def test_c_rolled_float32_forwards_add_their_terms_in_float_runs_at_any_horizon(control):
    """Past the thresholds C's float32 forward adds each term's rows in runs of fused.FLOAT_RUN_ROWS in
    float, as the straight-line form: one loop over the runs, each the loop over its steps then every
    term's run added to its double sum (the same statements at H=41, 64 and 256: its length does not
    grow with H); the float64 forward adds each row in double (no runs, no loop over them)."""
    integrator = "exact" if control == "jerk" else "semi_implicit_euler"
    bodies = []
    for H in (41, 64, 256):
        spec = _spec(horizon=H, control=control, integrator=integrator)
        code = lower(build_operator(spec), table(spec))
        for codes in [C.codes(code, ("forward",), 4)] + list(C.form_codes(code, ("forward",), 4).values()):
            [runs] = _float_run_loops(codes["forward"].statements)
            assert runs.step == fused.FLOAT_RUN_ROWS
            steps, *ends = runs.body
            assert isinstance(steps, For) and steps.var == "r"
            assert len(ends) == 2 * len(TERMS)  # each term's run into its double sum, then its float sum from 0
            assert all(f"crun{t}" in line for t in range(len(TERMS)) for line in codes["forward"].body
                       if f"cacc{t} +=" in line)
        bodies.append(len(C.codes(code, ("forward",), 4)["forward"].body))
        double = C.codes(code, ("forward",), 8)["forward"]
        assert not _float_run_loops(double.statements) and not any("crun" in line for line in double.body)
    assert bodies[1] == bodies[2], bodies


def _kernel_lines(source: str, kernel: str) -> int:
    """The lines of one entry point's definition in a CUDA source."""
    start = source.index(next(line for line in source.splitlines()
                              if line.endswith(f"_{kernel}(") or f"_{kernel}(int64_t" in line))
    return source[start:source.index("\n}\n", start)].count("\n")


def test_a_recurrences_cuda_columns_are_as_long_at_any_horizon():
    """A fused recurrence's CUDA forward (a loop over its steps) and adjoint (a reverse scan over segments,
    codegen/roll.py ``segmented``) are as long at H=256 as at H=64, give or take a segment's steps."""
    from tensorstep.codegen.driver import generate

    for control, dtype in (("velocity", "float64"), ("jerk", "float32")):
        lines = {}
        for H in (64, 256):
            spec = _spec(horizon=H, control=control, dtype=dtype, integrator="semi_implicit_euler")
            source = generate(spec, targets=("cuda",), parts=("core",)).source("cuda", "core")
            lines[H] = {k: _kernel_lines(source, k) for k in ("forward", "adjoint")}
        assert lines[256]["forward"] == lines[64]["forward"], (control, dtype, lines)
        # H=256 holds blocks of segments (two levels of checkpoints): two loops more, no more steps
        assert lines[256]["adjoint"] < 1.5 * lines[64]["adjoint"], (control, dtype, lines)


def test_c_recurrences_are_straight_line_to_their_threshold_and_as_long_at_any_horizon_past_it():
    """C's fused recurrence columns stay straight-line up to fused.C_ROLL_RECURRENCE_ABOVE_H rows and are
    rolled past it, every form (the forward one loop, the adjoint's reverse scan two, checkpoints in
    ``TS_CK``); past it the core module's C source (the lane form, each form's batch functions) is no
    longer at H=256 than just past the threshold, give or take a tenth (the steps before and
    after the loops), where the straight-line module grew by about 27 lines a row."""
    from tensorstep.codegen.driver import generate

    for control in ("velocity", "acceleration", "jerk"):
        integrator = "exact" if control == "jerk" else "semi_implicit_euler"
        for horizon, rolled in ((fused.C_ROLL_RECURRENCE_ABOVE_H, False), (fused.C_ROLL_RECURRENCE_ABOVE_H + 1, True)):
            spec = _spec(horizon=horizon, control=control, integrator=integrator)
            code = lower(build_operator(spec), table(spec))
            kernels = ("forward", "adjoint")
            variants = [C.codes(code, kernels, 8)] + list(C.form_codes(code, kernels, 8).values())
            assert len(variants) == 4  # the general form, narrow, unit rows, both
            for codes in variants:
                loops = [sum(isinstance(s, For) for s in codes[k].statements) for k in kernels]
                assert loops == ([1, 2] if rolled else [0, 0]), (control, horizon, loops)
                assert any("TS_CK(" in line for line in codes["adjoint"].body) == rolled
        dtype = "float32" if control == "acceleration" else "float64"
        sources = [generate(_spec(horizon=H, control=control, integrator=integrator, dtype=dtype), targets=("c",),
                            parts=("core",)).source("c", "core") for H in (fused.C_ROLL_RECURRENCE_ABOVE_H + 1, 256)]
        assert all("#define TS_LANES" in source for source in sources)
        lines = [source.count("\n") for source in sources]
        assert max(lines) <= 1.1 * lines[0], (control, dtype, lines)


#: float64 order-4 recurrences, a step's five rows a segment (the ptxas survey's, BENCHMARKS.md): every
#: carried row kept a step, their checkpoints were 6,304 and 4,000 bytes of the thread's stack frame; with
#: each the reverse scan's plan (``_scan_plan``): H=200 keeps no checkpoint in one-step segments, H=128 keeps
#: the acceleration in one level of 2-step segments (6 recomputed rows, within SCAN_REGISTERS' 8), not in two
#: levels of one-step ones (24 checkpoints, the blocks' steps run forward once more)
FEW_CHECKPOINTS = [
    (dict(control="velocity", horizon=200, integrator="semi_implicit_euler", dt="per_step", layout="bhd",
          outputs=("V",), costs=(("bound", "acceleration"), ("squared", "acceleration"))), (None, 1, False)),
    (dict(control="velocity", horizon=128, integrator="exact", dt="per_step", layout="bdh", outputs=("J", "S"),
          costs=(("squared", "jerk"),)), (62, 2, False)),
]


def _scan_plan(source: str) -> tuple[int | None, int, bool]:
    """A CUDA source's reverse scan (its adjoint's): the checkpoint array's values (None where it has none), the
    steps of its segments (the stride of its loops down) and whether it has two levels (loops over blocks, ``rs``)."""
    start = source.index("_adjoint(int64_t")
    adjoint = source[start:source.index("\n}\n", start)]
    array = re.search(r"TS_CHECKPOINTS\((\d+)\)", adjoint)
    down = {int(m[1] or 1) for m in re.finditer(r"for \(int64_t r = [^;]*; r >= [^;]*; (?:--r|r -= (\d+))\)", adjoint)}
    assert len(down) == 1, down
    return int(array[1]) if array else None, down.pop(), "int64_t rs" in adjoint


@pytest.mark.parametrize("fields, plan", FEW_CHECKPOINTS, ids=["velocity_h200", "velocity_exact_h128"])
def test_a_recurrences_cuda_checkpoints_are_the_values_a_segment_reads_within_the_budget(fields, plan):
    """A recurrence's CUDA reverse scan (codegen/roll.py ``segmented``) keeps, a segment, only the values
    its recomputation reads (not the position, nor the jerk a squared jerk term does not read back),
    reads the action again, and its checkpoint array fits fused.CHECKPOINT_BYTES; one level of segments
    as long as a segment's recomputed rows allow before two levels (``roll._plan``): the plan pinned."""
    spec = ts.KernelSpec(dof=7, dtype="float64", order=4, **fields)
    source = source_of(spec, "core")
    array = re.search(r"TS_CHECKPOINTS\((\d+)\)", source)
    assert array is None or int(array[1]) * 8 <= fused.CHECKPOINT_BYTES, array[1]
    assert "y0_q1" not in source and "y3_q1" not in source and "const T y1_q1 = U(" in source
    assert _scan_plan(source) == plan


def test_the_reverse_scans_plan_counts_its_whole_checkpoint_array():
    """``roll._block`` against every block: one level where the segments' checkpoints fit the budget,
    else the fewest steps a block whose array (the blocks', one for the segments before them, a block's
    segments') fits, None where none does; at H=256 (253 steps) three float64 values a step fit
    768 bytes in one-step segments, four do not."""
    from tensorstep.codegen import roll

    def array(length: int, size: int, block: int) -> int:
        n = length // block
        return n + ((length - n * block) // size > 0) + block // size

    # (and the longer segments ``segmented`` tries where none fits, against a budget of a few checkpoints)
    for budget in (48, 768):
        for length in range(2, 300, 7):
            for size in (1, 2, 3, 7):
                for checkpoint in (8, 16, 24, 32):
                    got = roll._block(length, size, checkpoint, budget)
                    fits = [b for b in range(size * roll.BLOCK_SEGMENTS, length + 1, size)
                            if array(length, size, b) * checkpoint <= budget]
                    if (length // size) * checkpoint <= budget:
                        assert got == size
                    else:
                        assert got == (fits[0] if fits else None), (length, size, checkpoint, budget)
    assert array(253, 1, roll._block(253, 1, 24, 768)) * 24 == 768 and roll._block(253, 1, 32, 768) is None


def test_the_reverse_scans_plan_takes_one_level_of_longer_segments_before_two_levels():
    """``roll._plan`` against its definition: the shortest segments from ``size`` to ``longest`` steps whose one
    level of checkpoints (a segment's) fits the budget, else ``_block``'s at ``size`` (two levels or None); the
    issue's H=128 run (125 steps, one float64 value a segment) in one level of 2-step segments, 496 bytes."""
    for length in range(2, 300, 7):
        for size, longest in ((1, 1), (1, 2), (1, 4), (2, 3)):
            for checkpoint in (8, 16, 24):
                got = roll._plan(length, size, longest, checkpoint, 768)
                one = [s for s in range(size, longest + 1) if (length // s) * checkpoint <= 768]
                assert got == ((one[0], one[0]) if one else (size, roll._block(length, size, checkpoint, 768)))
    assert roll._plan(125, 1, 2, 8, 768) == (2, 2) and roll._plan(125, 1, 1, 8, 768) == (1, 8)


def _cuda_adjoint(spec: ts.KernelSpec, budget: int, monkeypatch) -> tuple[int | None, int | None, bool]:
    """CUDA's float64 adjoint of ``spec`` with ``budget`` bytes of checkpoints (``fused.CHECKPOINT_BYTES``,
    which ``fused.rolled_adjoint`` reads at each call): its checkpoint array's values (``TS_CHECKPOINTS``,
    None where it has none), the steps of its segments (the shortest stride of its loops, None where it has none) and whether
    it has two levels (loops over blocks of segments, ``rs``)."""
    from tensorstep.codegen.statements import Call, walk

    monkeypatch.setattr(fused, "CHECKPOINT_BYTES", budget)
    statements = CUDA.codes(lower(build_operator(spec), table(spec)), ("adjoint",), 8)["adjoint"].statements
    array = [n.args[0] for n in walk(tuple(statements)) if isinstance(n, Call) and n.macro == "TS_CHECKPOINTS"]
    loops = [s for s in statements if isinstance(s, For)]
    return (array[0] if array else None, min((abs(s.step) for s in loops if s.var == "r"), default=None),
            any(s.var == "rs" for s in loops))


def test_a_reverse_scan_past_its_budget_takes_longer_segments_or_none_and_never_more_bytes(monkeypatch):
    """Where no block of ``roll.segmented``'s segments keeps checkpoints within the budget, the segments grow a
    step at a time until one level or two fit; where not even two segments' checkpoints fit, no scan, and
    CUDA's adjoint is the straight-line column. Its checkpoint array is within the budget at every one: a
    velocity recurrence at H=40 (two float64 values kept a segment) runs 2-step segments at 768 bytes (36
    checkpoints), 3-step ones in blocks of 24 steps at 160 (blocks of 2-step ones need 22 checkpoints, 176
    bytes), 10-step ones at 48 (9-step ones would need 64 bytes); at 16 bytes the straight-line column keeps
    none. (Their values: host runs in tests/kernels/test_costs.py.)"""
    spec = _spec(horizon=40, control="velocity", integrator="semi_implicit_euler", dtype="float64")
    expected = {fused.CHECKPOINT_BYTES: (36, 2, False), 160: (20, 3, True), 48: (6, 10, False), 16: (None, None, False)}
    for budget, (values, steps, blocks) in expected.items():
        got = _cuda_adjoint(spec, budget, monkeypatch)
        assert got[0] is None or got[0] * 8 <= budget, (budget, got)
        assert got == (values, steps, blocks), (budget, got)


@pytest.mark.parametrize("control", ["velocity", "acceleration", "jerk"])
def test_c_rolled_recurrence_adjoints_recompute_segments_of_the_same_rows_in_either_type(control):
    """C's rolled recurrence adjoint (a reverse scan over segments) recomputes fused.C_SCAN_ROWS rows a
    segment in float32 as in float64 (the lane form's values are vectors, a register each in either
    type): its loops step by the same steps, C_SCAN_ROWS over a step's rows; CUDA's float32 segments
    (``SCAN_REGISTERS`` 4-byte registers' worth) are twice its float64 ones."""
    integrator = "exact" if control == "jerk" else "semi_implicit_euler"
    spec = _spec(horizon=64, control=control, integrator=integrator)
    code = lower(build_operator(spec), table(spec))
    steps = fused.C_SCAN_ROWS // (len(code.op.rows) // spec.horizon)
    strides = lambda codes: {abs(s.step) for s in codes["adjoint"].statements if isinstance(s, For)}
    for itemsize in (4, 8):
        forms = list(C.form_codes(code, ("adjoint",), itemsize).values())
        for codes in [C.codes(code, ("adjoint",), itemsize)] + forms:
            assert strides(codes) == {steps}, (itemsize, strides(codes))
    cuda = [strides(CUDA.codes(code, ("adjoint",), itemsize)) for itemsize in (4, 8)]
    assert cuda[0] == {2 * s for s in cuda[1]}, cuda


#: fused B-splines (a knot span of ``steps`` rows, each span reading its window of knots)
BSPLINES = {
    "degree3": dict(control="bspline", degree=3, steps=4),
    "degree5_per_trajectory": dict(control="bspline", degree=5, steps=2, dt="per_trajectory"),
    "degree4_goal": dict(control="bspline", degree=4, steps=8, end="goal"),
}


@pytest.mark.parametrize("case", BSPLINES)
def test_a_fused_bsplines_cuda_columns_are_as_long_at_any_number_of_knots(case):
    """CUDA's fused forward and adjoint of a B-spline: the interior knot spans one loop over the knot
    variable kn each (codegen/fused.py ``Blocks``), the same statements at 12 and 40 knots."""
    lengths = []
    for knots in (12, 40):
        spec = _spec(horizon=None, knots=knots, **BSPLINES[case])
        codes = CUDA.codes(lower(build_operator(spec), table(spec)), ("forward", "adjoint"), 8)
        loops = [[s for s in codes[k].statements if isinstance(s, For)] for k in ("forward", "adjoint")]
        assert [[loop.var for loop in kernel] for kernel in loops] == [["kn"], ["kn"]]
        lengths.append([len(codes[k].body) for k in ("forward", "adjoint")])
    assert lengths[0] == lengths[1]


def test_c_rolls_a_bsplines_fused_columns_past_its_threshold_where_its_spans_repeat():
    """C's fused B-spline columns: straight-line up to fused.C_ROLL_ABOVE_H rows and where too few
    spans repeat for a loop (its straight-line columns, every form), one loop over the knots past it."""
    for knots, loops in ((5, 0), (6, 0), (7, 1), (16, 1)):  # 37, 41, 45 and 81 rows
        spec = ts.KernelSpec(control="bspline", degree=3, knots=knots, steps=4, dof=2, costs=TERMS, outputs=("P",))
        code = lower(build_operator(spec), table(spec))
        kernels = ("forward", "adjoint")
        for codes in [C.codes(code, kernels, 4)] + list(C.form_codes(code, kernels, 4).values()):
            knot_loops = [sum(isinstance(s, For) and s.var == "kn" for s in codes[k].statements) for k in kernels]
            assert knot_loops == [loops] * 2


# three rows a span (runs end within a span) and a seeded one of the two whose runs end at a span's end
# (all under TENSORSTEP_FULL_SWEEP=1): each step's rows test where a run ends whatever the span's rows
@pytest.mark.parametrize("degree, steps", [(3, 3), *sample([(4, 8), (5, 4)], 1, seed=11)])
def test_c_rolled_float32_bspline_forwards_add_their_terms_in_float_runs_across_knot_spans(degree, steps):
    """Past the threshold C's float32 B-spline forward adds each term's rows in runs of
    fused.FLOAT_RUN_ROWS in float, as the straight-line form, though a run crosses knot spans: in the
    loop over the knots each step's rows test whether they end a run (``RunEnd``: its terms' runs into
    their double sums, one test a step), so every term's rows are in a float sum and each sum is
    folded there; the same statements at 16 and 40 knots; the float64 forward has no runs."""
    from tensorstep.codegen.statements import RunEnd, transform, walk

    bodies = []
    for knots in (16, 40):
        spec = ts.KernelSpec(control="bspline", degree=degree, knots=knots, steps=steps, dof=2, costs=TERMS,
                             outputs=("P",))
        code = lower(build_operator(spec), table(spec))
        for codes in [C.codes(code, ("forward",), 4)] + list(C.form_codes(code, ("forward",), 4).values()):
            [loop] = [s for s in codes["forward"].statements if isinstance(s, For)]
            assert loop.var == "kn"
            ends = [n for n in walk(loop.body) if isinstance(n, RunEnd)]
            assert len(ends) == steps and all(e.length == fused.FLOAT_RUN_ROWS for e in ends)
            assert all(f"cacc{t} += (double)(crun{t})" in "\n".join(codes["forward"].body) for t in range(len(TERMS)))
            assert not any(f"cacc{t} +=" in line and f"crun{t}" not in line for t in range(len(TERMS))
                           for line in codes["forward"].body)  # (no row added straight in double)
        # the loop's statements, but for the column's last row its tests name
        [loop] = [s for s in C.codes(code, ("forward",), 4)["forward"].statements if isinstance(s, For)]
        unlast = lambda n: dataclasses.replace(n, last=None) if isinstance(n, RunEnd) else None
        bodies.append(transform(loop.body, unlast))
        double = C.codes(code, ("forward",), 8)["forward"]
        assert not any(isinstance(n, RunEnd) for n in walk(tuple(double.statements)))
    assert bodies[0] == bodies[1]


#: the limit on a body's longest stretch that these rolled adjoints are longer than in all (the value it had
#: when they were measured; LANE_MAX_LINES is longer now, past every rolled adjoint here)
WHOLE_BODY_PAST = 1000


@pytest.mark.parametrize("degree, knots, steps", [(5, 10, 4), (6, 12, 4), (5, 24, 4)])
def test_c_lane_form_limits_a_rolled_columns_stretches_not_its_length(degree, knots, steps, monkeypatch):
    """codegen/render.py gives a column the lane form where its longest straight-line stretch is within
    ``LANE_MAX_LINES`` (codegen/roll.py ``longest_stretch``: the statements before, inside and after each
    loop apart; gcc's time grows with a block's length): a rolled B-spline adjoint with the bench's seven
    terms at degree 5 and 6, longer in all than the limit (here 1,000 lines), has it in every form, at any
    number of knots; the straight-line columns past the limit do not."""
    from tensorstep.bench.costs import TERMS as BENCH_SEVEN
    from tensorstep.codegen import macros, render, roll
    from tensorstep.codegen.lower import _live
    from tensorstep.codegen.printer import lane_printer

    monkeypatch.setattr(render, "LANE_MAX_LINES", WHOLE_BODY_PAST)
    spec = ts.KernelSpec(control="bspline", degree=degree, knots=knots, steps=steps, dof=7, costs=BENCH_SEVEN,
                         outputs=("P",))
    code = lower(build_operator(spec), table(spec))
    kernels = ("forward", "adjoint")
    printer = lane_printer(macros.lane_names(code.arguments))
    for codes in [C.codes(code, kernels, 4)] + list(C.form_codes(code, kernels, 4).values()):
        adjoint = codes["adjoint"].statements
        assert any(isinstance(s, For) and s.var == "kn" for s in adjoint)
        assert roll.longest_stretch(adjoint, printer.lines) <= render.LANE_MAX_LINES < len(printer.lines(adjoint))
        assert set(render._lane_bodies(code, codes, kernels, code.arguments)) == set(kernels)
    straight = fused.adjoint(code.op, code.coefs, code.refs, code.arguments, fused.paired_rows, _live)
    assert roll.longest_stretch(straight, printer.lines) == len(printer.lines(straight)) > render.LANE_MAX_LINES


#: fused columns whose longest stretch passes 1,000 lines (the limit before gcc's time on them was surveyed),
#: with the stretch and the kernels it is in: rolled B-spline adjoints (degree 7 with 4 rows a span: the first
#: spans; degree 4 with 8), straight-line ones (too few knots for a loop: 3 rows a span at degree 3, 8 at
#: degree 5, the forward too), a straight-line stencil (H=40) with the eight terms; the dtypes taking turns
#: (the lines are the same in either)
PAST_1000 = [
    (dict(control="bspline", degree=7, knots=14, steps=4, dtype="float32"), ("adjoint",), 1190),
    (dict(control="bspline", degree=4, knots=20, steps=8, dtype="float64"), ("adjoint",), 1237),
    (dict(control="bspline", degree=3, knots=6, steps=6, dtype="float32"), ("adjoint",), 1392),
    (dict(control="bspline", degree=5, knots=6, steps=8, dtype="float64"), ("forward", "adjoint"), 2534),
    (dict(horizon=40, dtype="float32"), ("adjoint",), 1033),
]


@pytest.mark.parametrize("fields, kernels, stretch", PAST_1000, ids=lambda v: str(v) if isinstance(v, int) else None)
def test_c_columns_past_1000_lines_have_the_lane_form(fields, kernels, stretch):
    """Where a fused column's longest stretch is past 1,000 lines but within ``LANE_MAX_LINES``, every C
    form's forward and adjoint have the lane form (they ran the per-dof loop: 2.6-8x the lane form's time and
    2-30x its gcc time); the kernels named are the ones past 1,000 lines."""
    from tensorstep.bench.costs import TERMS as BENCH_SEVEN
    from tensorstep.codegen import macros, render, roll
    from tensorstep.codegen.printer import lane_printer

    every = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + tuple(
        ("squared", s) for s in ("position", "velocity", "acceleration", "jerk"))
    spec = ts.KernelSpec(dof=7, costs=BENCH_SEVEN if "control" in fields else every, outputs=("P",), **fields)
    code = lower(build_operator(spec), table(spec))
    itemsize = 4 if spec.dtype == "float32" else 8
    printer = lane_printer(macros.lane_names(code.arguments))
    for codes in [C.codes(code, ("forward", "adjoint"), itemsize)] + list(
            C.form_codes(code, ("forward", "adjoint"), itemsize).values()):
        stretches = {k: roll.longest_stretch(codes[k].statements, printer.lines) for k in ("forward", "adjoint")}
        assert {k for k, n in stretches.items() if n > 1000} == set(kernels)
        assert max(stretches.values()) <= render.LANE_MAX_LINES
        assert set(render._lane_bodies(code, codes, ("forward", "adjoint"), code.arguments)) == {"forward", "adjoint"}
    assert stretches["adjoint"] == stretch


@pytest.mark.parametrize("degree, steps", [(3, 2), (3, 8), (5, 3)])
def test_a_bsplines_rolled_columns_are_built_only_where_a_knot_loop_forms(degree, steps):
    """``fused_rolled`` decides from the operator's spans (``lower._knot_loop_possible``) whether a
    knot loop can form before it builds a B-spline's rolled column: at every knot count around the
    first that forms one, its answer (None: no loop) is the one building the column gives, for the
    forward and the adjoint, costs on every state or on velocity only (the adjoint's groups then
    hold the velocity rows and P's)."""
    from tensorstep.codegen.lower import _knot_phase, _live, _period

    for terms in (TERMS, (("squared", "velocity"),)):
        for knots in range(degree + 2, degree + 7):
            spec = ts.KernelSpec(control="bspline", degree=degree, knots=knots, steps=steps, dof=2, costs=terms,
                                 outputs=("P",))
            code = lower(build_operator(spec), table(spec))
            p = _period(code.op)
            blocks = fused.Blocks(p, _knot_phase(code.op, p))
            for kernel, build in (("forward", fused.forward_rolled), ("adjoint", fused.adjoint_rolled)):
                built = build(code.op, code.coefs, code.refs, code.arguments, _live, blocks=blocks)
                loop = any(isinstance(s, For) for s in built)
                assert (code.fused_rolled(kernel) is not None) == loop, (degree, steps, knots, terms, kernel)


def test_a_fused_bsplines_cuda_columns_copy_only_the_factors_they_read():
    """With a dt per trajectory, CUDA's fused B-spline columns read each coefficient as a factor of
    the block's copy in shared memory times the thread's power of its dt. The copy holds the leading
    slots the columns read (the first slot of each distinct value: codegen/render.py ``factors_read``),
    as many at 12 and 24 knots, where the table grows with the knots (its blocks of copies for the
    unfused loops) and did not fit whole: the factors then stayed constants that ptxas folded and
    kept live (spills)."""
    from tensorstep.codegen.targets import CUDA_SHARED_COEF_BYTES

    copied = []
    for knots in (12, 24):
        spec = _spec(horizon=None, control="bspline", degree=3, knots=knots, steps=8, dt="per_trajectory",
                     dtype="float64")
        source = source_of(spec, "core")
        size = lower(build_operator(spec), table(spec)).coefs.size
        read = 1 + max(int(q) for q in re.findall(r"\bC\((\d+)\)", source))
        copies = [int(n) for n in re.findall(r"__shared__ double ts_mono_c\[(\d+)\];", source)]
        assert copies == [read, read], (knots, copies, read)  # the forward's and the adjoint's
        assert read * 8 <= CUDA_SHARED_COEF_BYTES < size * 8, (knots, read, size)
        copied.append(read)
    assert copied[0] == copied[1]
