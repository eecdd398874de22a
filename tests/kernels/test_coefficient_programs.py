"""Per-step dt kernels at horizons where the coefficient programs are rolled into loops:
their source grows linearly with H, and their values and dt derivatives match the
independent float64 reference (tests/reference.py) and its finite differences."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import tensorstep as ts
from tensorstep.codegen.driver import generate

import reference
from helpers import Inputs, c_functions, dt_gradient, dt_value, grid_id, scale_close, to_bhd

H_ROLLED = 40  # long enough that interior rows repeat and are emitted as loops

PER_STEP = [
    dict(difference="central"),
    dict(difference="central", accuracy=4, order=4, start_index=True),
    dict(difference="central", end="one_sided", accuracy=(2, 4, 2)),
    dict(difference="backward"),
    dict(difference="backward", accuracy=3, order=4),
    dict(control="acceleration", integrator="exact"),
    dict(control="jerk", integrator="semi_implicit_euler", order=4),
]


def _spec(overrides: dict, horizon: int = H_ROLLED, dtype: str = "float64") -> ts.KernelSpec:
    return ts.KernelSpec(horizon=horizon, dof=2, dtype=dtype, dt="per_step", **overrides)


def _dt_source_size(spec: ts.KernelSpec) -> int:
    g = generate(spec, targets=("c", "cuda"), parts=("core", "dt"))
    return sum(len(text) for text in g.sources.values())


@pytest.mark.parametrize("overrides", [dict(difference="central"), dict(difference="backward", accuracy=3)],
                         ids=grid_id)
def test_per_step_source_grows_linearly(overrides):
    """The coefficient programs and their derivatives are loops over the interior rows: the
    source grows by a fixed amount per row (it grew superlinearly, 1.26 MB at H=64)."""
    sizes = {h: _dt_source_size(_spec(overrides, h, "float32")) for h in (32, 64, 128)}
    per_row = [(sizes[b] - sizes[a]) / (b - a) for a, b in ((32, 64), (64, 128))]
    # bytes per added row: steady, or so few that longer indices (a digit more at 100) are most of them
    assert per_row[1] < max(1.4 * per_row[0], 200), sizes
    assert sizes[128] < 2.2 * sizes[64], sizes
    assert sizes[128] < 600_000, sizes


def test_interior_rows_are_one_loop_in_each_program():
    source = generate(_spec(dict(difference="central"), 64), targets=("c",), parts=("dt",)).source("c", "dt")
    functions = c_functions(source)
    finish = "".join(text for name, text in functions.items() if "_dt_vjp_finish" in name)
    assert finish.count("for (int64_t r = ") == 1
    assert "GDT(r + " in finish or "GDT(r - " in finish or "GDT(r)" in finish


WIDE_BOUNDARIES = [dict(difference="central", accuracy=4, order=4, start_index=True),
                   dict(difference="backward", accuracy=3, order=4, start_index=True)]


@pytest.mark.parametrize("overrides", WIDE_BOUNDARIES, ids=grid_id)
def test_long_coefficient_programs_are_tapes(overrides):
    """Wide one-sided boundary stencils make the straight-line part of the coefficient programs
    (table, dt_jvp's tangent, dt_vjp_finish's reverse) thousands of lines at any H: gcc -O3 took
    7-9 s on them at H=256, and unoptimised still seconds. Each such part is a tape now (data,
    run by one small loop: codegen/tape.py), the loops over the interior rows a function of
    their own at -O2 without the vectoriser (TS_ROWS: -O2's cheap vectoriser took 1.7 of 3.1 s
    of gcc on a wide stencil's tangent rows), and every function stays short."""
    source = generate(_spec(overrides, 256, "float32"), targets=("c",), parts=("core", "dt")).source("c", "dt")
    assert '#define TS_ROWS __attribute__((optimize("O2", "no-tree-vectorize", TS_CHEAP_ALLOCATION)))' in source
    functions = c_functions(source)
    kernel = lambda k: next(text for name, text in functions.items() if name.endswith(f"_{k}"))
    assert "TS_TAPE_REVERSE();" in kernel("dt_vjp_finish")
    assert "TS_TAPE_TANGENT();" in kernel("coefficients_jvp")
    assert "_coefficients_jvp(dt_in, ddt_in, coef, coefd);" in kernel("dt_jvp")
    for name, text in functions.items():
        head, lines = text.splitlines()[0], text.count("\n")
        if "TS_ROWS" in head:
            assert "for (int64_t r = " in text and lines < 800, (name, lines)
        else:
            assert lines < 400, (name, lines)


@pytest.mark.parametrize("overrides, targets, dt_bytes", [
    (dict(difference="central", accuracy=8), ("c", "cuda"), 1_100_000),  # was 1.48 MB
    (dict(difference="backward", accuracy=8, order=4, end="goal", goal_index=True), ("c",), 2_200_000),  # 3.88 MB
], ids=["central_a8", "backward_a8_o4_goal"])
def test_wide_per_step_tapes_come_from_the_formulas(overrides, targets, dt_bytes):
    """Accuracy 8 with a duration per step, H=256: the boundary rows' Lagrange weights go into the
    value tape as their formulas (each distinct subexpression once), and the tangent and reverse
    tapes are that tape differentiated (codegen/tape.py), so the generator never expands, CSEs or
    differentiates them in SymPy. Before, that was 4-21 s of generation and 1.5-3.9 MB of dt
    source per library (docs/benchmarks-history.md, thirteenth session). The tapes' numerics:
    tests/kernels/test_tape.py."""
    from tensorstep.codegen.driver import lowered

    spec = ts.KernelSpec(horizon=256, dof=7, dtype="float32", dt="per_step", start_index=True, **overrides)
    generated = generate(spec, targets=targets, parts=("core", "dt"))
    coefs = lowered(spec).coefs
    assert coefs.taped and coefs.has_formulas
    assert "lines" not in vars(coefs)  # the CSE'd straight-line program was never made
    assert len(generated.source("c", "dt")) < dt_bytes
    tangent = coefs.tape("tangent")
    assert tangent.registers < 6144  # a CUDA block's 48 KB of shared memory, in doubles


def test_per_trajectory_tables_are_data():
    """With a dt per trajectory the table is filled per trajectory, inside the kernels. This
    B-spline's (4965 slots) was straight-line code there: 794 KB of C for the dt library and
    36 s of gcc (6.7 s for the core library). Every slot is c·dt^p of the trajectory's dt, so
    the table is two arrays and a loop now (codegen/monomials.py): the functions that fill it
    and take its dt gradient are short, and each library's source a fraction of that size."""
    spec = ts.KernelSpec(control="bspline", degree=4, knots=10, steps=25, dt="per_trajectory", dof=7,
                         dtype="float32")
    for part in ("core", "dt"):
        source = generate(spec, targets=("c",), parts=(part,)).source("c", part)
        assert "TS_MONOMIALS_VALUE();" in source
        assert len(source) < 200_000, (part, len(source))
        programs = {name: text for name, text in c_functions(source).items()
                    if name.endswith(("_coefficients", "_dt_vjp_finish"))}
        assert len(programs) == (1 if part == "core" else 2)
        for name, text in programs.items():
            assert text.count("\n") < 20, (part, name, text.count("\n"))


@pytest.mark.parametrize("knots", [10, 20])
@pytest.mark.parametrize("dt", ["uniform", "per_trajectory"])
def test_bspline_dt_kernels_are_span_loops(knots, dt):
    """A B-spline's dt kernels loop over each span's rows (over the knots where enough repeat),
    not over the knots once per phase and output: with 12 steps per knot that was 48 loops per
    kernel, 513 lines of dt_jvp and 941 of dt_vjp, and 3.5-3.8 s of gcc for the dt library."""
    spec = ts.KernelSpec(control="bspline", degree=4, knots=knots, steps=12, dt=dt, dof=7, dtype="float32")
    functions = c_functions(generate(spec, targets=("c",), parts=("dt",)).source("c", "dt"))
    for kernel in ("dt_jvp", "dt_vjp"):
        (text,) = [text for name, text in functions.items() if name.endswith("_" + kernel)]
        assert text.count("\n") < 300, (kernel, text.count("\n"))


@pytest.mark.parametrize("spec", [
    ts.KernelSpec(horizon=32, dof=7, dtype="float32"),
    ts.KernelSpec(control="bspline", degree=4, knots=3, steps=4, end="goal", start_index=True, dof=7),
    ts.KernelSpec(horizon=16, control="jerk", dt="per_step", layout="bdh", dof=3),
], ids=["central", "bspline_goal", "jerk_bdh"])
def test_missing_input_tangents_read_a_zero_block(spec):
    """dt_jvp without some input tangent (a tangent in dt alone: du, dp0, ... are NULL) reads
    zeros from a block, through per-batch-element bases chosen once: a test of the pointer at
    every load ("du ? du[i] : 0") became AVX-512 loads masked by du != NULL, and a masked load
    from a null address costs a microcode assist each time (3.1 ms against 0.1 ms, central
    differences, H=32, B=400). The tangents' values are checked by the dt_jvp tests."""
    source = generate(spec, targets=("c",), parts=("dt",)).source("c", "dt")
    (jvp,) = [text for name, text in c_functions(source).items() if name.endswith("_dt_jvp")]
    assert "const T* restrict dub = du ? du + b * U_SB : ts_zero_actions;" in jvp
    for macro in ("DU(j)", "SDU(rel)", "DS0", "DS3"):  # redefined over the bases, without a test
        assert re.search(r"#undef %s\n#define %s [^?\n]*\n" % (re.escape(macro.split("(")[0]), re.escape(macro)),
                         source), macro


@pytest.mark.parametrize("spec", [
    ts.KernelSpec(control="bspline", degree=4, knots=60, steps=4, dof=7, dtype="float32"),
    ts.KernelSpec(horizon=64, difference="central", dt="per_step", dof=7, dtype="float32"),
    ts.KernelSpec(horizon=64, control="acceleration", integrator="exact", dt="per_trajectory", dof=7),
], ids=["bspline_n60", "central_per_step", "acceleration_per_trajectory"])
def test_dt_vjp_is_compiled_without_the_vectoriser(spec):
    """dt_vjp's dof loop is serial (every dof adds into the same accumulators), so -O3's
    vectoriser has nothing to do there, while its register allocation over the long body was
    most of gcc's time on a B-spline's dt library (60 knots: 2.8 of 3 s). dt_vjp is compiled at
    -O2 under gcc (TS_SERIAL), with the allocator's cheaper settings (TS_CHEAP_ALLOCATION, also
    on the once-per-call row loops); its numerics are checked by the dt tests on the built library."""
    source = generate(spec, targets=("c",), parts=("dt",)).source("c", "dt")
    assert '#define TS_SERIAL __attribute__((optimize("O2", TS_CHEAP_ALLOCATION)))' in source
    assert '#define TS_CHEAP_ALLOCATION "ira-algorithm=priority", "ira-region=one", "no-lra-remat"' in source
    functions = {name: text for name, text in c_functions(source).items() if name.endswith(("_dt_vjp", "_dt_vjp_batch"))}
    assert len(functions) == 2  # the entry point and its batch loop
    for text in functions.values():
        assert "TS_SERIAL " in text.splitlines()[0]
        assert "TS_SIMD" not in text


_STRAIGHT_PRODUCT = re.compile(r"^\s*ACC\((\d+)\) \+= \(double\)\((G\d\(\d+\))\*U\((\d+)\)\);$", re.M)


@pytest.mark.parametrize("overrides", WIDE_BOUNDARIES, ids=grid_id)
def test_dt_vjp_boundary_rows_loop_over_their_actions(overrides):
    """With a duration per step every boundary row has coefficients of its own, so dt_vjp gathers
    row h's G<k>(h)·U(j) into consecutive accumulator slots for consecutive actions j: each such
    run is one loop over the actions (as separate statements they were most of gcc's time on the
    widest stencil's dt_vjp: docs/benchmarks-history.md,
    seventeenth session, item 1), in C and CUDA alike. The loops' numerics are checked by
    the dt gradient tests against finite differences of the reference (C and CUDA on the host)."""
    spec = _spec(overrides, 64, "float32")
    generated = generate(spec, targets=("c", "cuda"), parts=("dt",))
    loop = re.compile(r"for \(int64_t r = (\d+); r <= (\d+); \+\+r\) \{\n\s*"
                      r"ACC\((\d+) \+ 1 \* \(r - \1\)\) \+= \(double\)\(G\d\(\d+\)\*U\(r\)\);")
    for target in ("c", "cuda"):
        source = generated.source(target, "dt")
        # the C body is in the batch function (over chunks of the batch), CUDA's in the per-column
        # function the kernel calls
        body = f"{spec.name}_dt_vjp_batch(" if target == "c" else f"{spec.name}_dt_vjp_column("
        dt_vjp = source[source.index(body):]
        loops = loop.findall(dt_vjp)
        assert len(loops) >= 4 and all(int(last) - int(first) + 1 >= 3 for first, last, _ in loops), (target, loops)
        # what is left straight-line: no two statements in a row that a loop would have continued
        products = [(m.start(), int(m.group(1)), m.group(2), int(m.group(3))) for m in _STRAIGHT_PRODUCT.finditer(dt_vjp)]
        for (at, q, g, j), (at2, q2, g2, j2) in zip(products, products[1:]):
            adjacent = dt_vjp.count("\n", at, at2) == 1
            assert not (adjacent and (q2, g2, j2) == (q + 1, g, j + 1)
                        and any(p[1:] == (q + 2, g, j + 2) for p in products)), (target, q, g, j)


def test_program_derivatives_are_sympys():
    """The coefficient programs' lines are differentiated by a small chain rule (sp.diff costs
    about ten times more): the same expressions as sp.diff, for every line and input."""
    import sympy as sp

    from tensorstep.codegen.arguments import table
    from tensorstep.codegen.builders import build_operator
    from tensorstep.codegen.coefficients import partial
    from tensorstep.codegen.lower import lower

    for overrides in (*WIDE_BOUNDARIES, dict(control="jerk", integrator="exact", order=4)):
        spec = _spec(overrides, 16)
        coefs = lower(build_operator(spec), table(spec)).coefs
        lines = list(coefs.lines) + [line for run in coefs.runs for line in run.lines]
        for _, e in lines:
            for a in e.free_symbols | {sp.Symbol("absent")}:
                assert partial(e, a) == sp.diff(e, a), (e, a)


def _reference_outputs(spec, dt: np.ndarray, x: Inputs) -> np.ndarray:
    return np.asarray(reference.apply(spec, dt.tolist(), x.numpy_u_bhd(), x.numpy_start()))


@pytest.mark.parametrize("overrides", PER_STEP, ids=grid_id)
def test_rolled_forward_matches_reference(overrides):
    spec = _spec(overrides)
    x = Inputs(spec)
    dt = dt_value(spec)
    outs = ts.load(spec, "cpu")(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    expected = _reference_outputs(spec, dt.numpy(), x)
    for k, y in enumerate(outs):
        scale_close(to_bhd(y, spec), expected[k], 1e-11)


def _finite_difference(spec, dt: np.ndarray, x: Inputs, direction: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d/dε reference(dt + ε·direction) at ε = 0, by a fourth-order central difference."""
    f = lambda e: _reference_outputs(spec, dt + e * direction, x)
    return (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)


@pytest.mark.parametrize("overrides", PER_STEP, ids=grid_id)
def test_rolled_dt_vjp_matches_finite_differences(overrides):
    """The dt gradient of Σ g·Y, projected on random directions, against finite differences of
    the reference along them."""
    spec = _spec(overrides)
    x = Inputs(spec)
    dt = dt_value(spec, requires_grad=True)
    got, g = dt_gradient(spec, x, dt)
    rng = np.random.default_rng(7)
    for direction in rng.normal(size=(3, spec.horizon)):
        expected = float((g * _finite_difference(spec, dt.detach().numpy(), x, direction)).sum())
        actual = float(got @ direction)
        assert abs(actual - expected) <= 1e-7 * max(1.0, abs(expected)), (actual, expected)


@pytest.mark.parametrize("overrides", PER_STEP, ids=grid_id)
def test_rolled_dt_jvp_matches_finite_differences(overrides):
    """The outputs' tangent along a random dt direction (forward mode) against finite differences."""
    spec = _spec(overrides)
    x = Inputs(spec)
    dt = dt_value(spec)
    direction = torch.randn(spec.horizon, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    step = ts.load(spec, "cpu")
    with fwAD.dual_level():
        outs = step(x.u, x.p0, x.v0, x.a0, fwAD.make_dual(dt, direction), **x.kwargs())
        tangents = [fwAD.unpack_dual(y).tangent for y in outs]
    expected = _finite_difference(spec, dt.numpy(), x, direction.numpy())
    for k, t in enumerate(tangents):
        scale_close(to_bhd(t, spec), expected[k], 1e-7)


@pytest.mark.parametrize("overrides", [dict(difference="central"), dict(control="acceleration", integrator="exact")],
                         ids=grid_id)
def test_rolled_float32_matches_float64(overrides):
    x64 = Inputs(_spec(overrides))
    x32 = Inputs(_spec(overrides, dtype="float32"))
    out64 = ts.load(_spec(overrides))(x64.u, x64.p0, x64.v0, x64.a0, dt_value(_spec(overrides)), **x64.kwargs())
    spec32 = _spec(overrides, dtype="float32")
    out32 = ts.load(spec32)(x32.u, x32.p0, x32.v0, x32.a0, dt_value(spec32), **x32.kwargs())
    for a, b in zip(out32, out64):
        scale_close(a.double().numpy(), b.numpy(), 2e-5)


def test_a_slow_uncached_build_says_what_it_is_doing(monkeypatch, capfd, tmp_path):
    from tensorstep.runtime import cache, cbackend

    monkeypatch.setattr(cache, "SLOW_BUILD_S", 0.0)
    monkeypatch.setattr(cache, "WAIT_GAP_S", 0.0)  # a wait of its own, whatever an earlier test built
    spec = ts.KernelSpec(horizon=9, dof=1, dtype="float64", dt="per_step", difference="backward")
    store = cache.BuildCache(tmp_path)
    cbackend.load_library(spec, "dt", store)
    err = capfd.readouterr().err
    assert f"tensorstep: compiling {spec.name} (dt kernels, H=9)..." in err
    cbackend.load_library(spec, "dt", store)  # cached: nothing to say
    assert "tensorstep: compiling" not in capfd.readouterr().err


def test_rolled_source_is_the_same_in_every_process():
    """The rolled programs are built from SymPy symbol sets: their order must not follow the
    process's hash seed (generated files are compared byte for byte)."""
    import os
    import subprocess
    import sys

    code = ("from tensorstep.codegen.driver import generate; from tensorstep.codegen.spec import KernelSpec; "
            "print(generate(KernelSpec(horizon=40, dof=2, dt='per_step'), ('c',), ('all',)).source('c', 'all'))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1", "2")}
    assert len(outputs) == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_generation_pauses_the_cycle_collector_and_restores_it(monkeypatch, enabled):
    """The stages run without Python's cycle collector (its passes over a heap holding PyTorch
    cost a fifth of a long generation) and leave it as they found it."""
    import gc

    from tensorstep.codegen import render as render_module

    during = []
    real = render_module.render
    monkeypatch.setattr(render_module, "render", lambda *a, **k: during.append(gc.isenabled()) or real(*a, **k))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        generate(_spec(dict(difference="central"), 8), targets=("c",), parts=("core",))
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert during == [False]


def test_rows_apply_the_lagrange_formulas_without_sympys_function_call(monkeypatch):
    """A per-step row's weights apply the shared Lagrange formulas: made directly, not through
    SymPy's function call (its argument checks and evaluation cost most of the operator stage at
    long horizons), and equal to what that call makes."""
    from sympy.core.function import AppliedUndef

    from tensorstep.codegen.builders import build_operator
    from tensorstep.codegen.operator import is_formula

    calls = []
    real = AppliedUndef.__new__
    monkeypatch.setattr(AppliedUndef, "__new__", lambda cls, *a, **k: calls.append(cls) or real(cls, *a, **k))
    op = build_operator(_spec(dict(difference="backward", accuracy=4, order=4), 16))
    applied = [c for row in op.rows for c, _ in row.terms for c in c.atoms(AppliedUndef) if is_formula(c)]
    assert len(applied) > 16 and calls == []
    monkeypatch.setattr(AppliedUndef, "__new__", real)
    assert all(c == c.func(*c.args) and hash(c) == hash(c.func(*c.args)) for c in applied)


def test_rows_share_the_relative_times_without_rebuilding_them(monkeypatch):
    """A row's node times relative to the row (sums of durations from it) are recognised by their
    terms: a longer horizon builds no more relative definitions, however many rows it has."""
    from tensorstep.codegen import coefficients
    from tensorstep.codegen.arguments import table
    from tensorstep.codegen.builders import build_operator
    from tensorstep.codegen.lower import lower

    built = []
    real = coefficients._Relative.expr
    monkeypatch.setattr(coefficients._Relative, "expr", lambda self, e, h: built.append(h) or real(self, e, h))
    counts = []
    for horizon in (40, 80):
        built.clear()
        spec = _spec(dict(difference="backward", accuracy=4, order=4), horizon)
        code = lower(build_operator(spec), table(spec))
        assert code.coefs.runs
        counts.append(len(built))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("goal", [False, True])
def test_node_times_are_sympys_sums_made_without_sorting(goal, monkeypatch):
    """t_j - t_h is a sum of durations: the same object SymPy's Add makes (equal, same hash, same
    argument order), made without Add's flattening and sorting where the durations are distinct
    and no ghost point's multiple is added."""
    import sympy as sp

    from tensorstep.codegen.operator import dt_symbols, step_durations
    from tensorstep.codegen.schemes import PositionPoints

    horizon = 24
    points = PositionPoints(horizon, step_durations(dt_symbols(horizon, "per_step"), horizon), goal)
    sp.core.cache.clear_cache()  # (else an Add made before comes from SymPy's cache, unflattened)
    flattened = []
    real = sp.Add.flatten
    monkeypatch.setattr(sp.Add, "flatten", classmethod(lambda cls, seq: flattened.append(1) or real.__func__(cls, seq)))
    made = {(j, h): points.time(j, h) for j in range(horizon) for h in range(horizon)}
    assert flattened == []
    monkeypatch.setattr(sp.Add, "flatten", real)
    dts = step_durations(dt_symbols(horizon, "per_step"), horizon)
    for (j, h), time in made.items():
        expected = sp.Add(*dts[h + 1 : j + 1]) if j >= h else -sp.Add(*dts[j + 1 : h + 1])
        assert time == expected and hash(time) == hash(expected) and time.args == expected.args
