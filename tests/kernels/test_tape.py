"""Long straight-line coefficient programs kept as data (codegen/tape.py), their dt derivatives
taken on the tape.

Each tape is run here the way a GPU block runs it: level by level, every instruction of a level
reading the registers as the level before left them; the run fails if an instruction of a level
writes a register another one of that level reads or writes (a race on the GPU). What the tape
stores is checked against the operator's coefficient expressions, evaluated by SymPy's lambdify
in float64 (values), with a complex step (dt tangents) and a complex step per duration (the dt
gradient). The kernels that run tapes are checked against the dense reference by the numerics
tests (test_dt_stencils.py for B-splines; here for per-step stencils of order 4) and for build cost by
test_coefficient_programs.py and test_ptxas.py.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp
import torch
import torch.autograd.forward_ad as fwAD

import reference
import tensorstep as ts
from helpers import Inputs, kernel_paths, scale_close, to_bhd
from tensorstep.codegen.coefficients import TAPE_ABOVE_LINES
from tensorstep.codegen.driver import generate, lowered
from tensorstep.codegen.operator import expand_formulas

#: per-step stencils of order 4 (central and backward), one with a goal at the end (with one dt,
#: programs are monomials: test_single_dt_programs_are_monomials_on_every_target)
TAPED = [
    dict(difference="central", accuracy=4, dt="per_step", order=4, horizon=40),
    dict(difference="backward", accuracy=3, dt="per_step", horizon=40),
    dict(difference="backward", accuracy=8, dt="per_step", horizon=16, end="goal"),
]
STEP = 1e-30  # complex step: the derivative is the imaginary part over STEP, exact to rounding

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
WITH_CONSTANT = {"addc": lambda x, c: x + c, "mulc": lambda x, c: x * c, "rdivc": lambda x, c: c / x,
                 "rsubc": lambda x, c: c - x, "powc": lambda x, c: x ** c}


def spec_of(overrides: dict) -> ts.KernelSpec:
    return ts.KernelSpec(dof=2, dtype="float64", **overrides)


def run_by_levels(tape, inputs: dict[str, np.ndarray]) -> dict[str, dict[int, complex]]:
    """The tape's stores by table and slot, run level by level as a block of threads would."""
    registers = np.full(tape.registers, np.nan, dtype=complex)
    stored: dict[str, dict[int, complex]] = {"C": {}, "CD": {}, "GDT": {}}
    for lo, hi in zip(tape.levels, tape.levels[1:]):
        level = tape.instructions[lo:hi]
        written = [i.dst for i in level if i.dst >= 0]
        read = set()
        for i in level:
            if i.op in BINARY:
                read |= {i.a, i.b}
            elif i.op in WITH_CONSTANT or i.op == "neg":
                read.add(i.a)
            elif i.op in stored:
                read.add(i.b)
        assert len(set(written)) == len(written), "two instructions of a level write one register"
        assert not set(written) & read, "an instruction writes a register another of its level reads"
        new = {}
        for i in level:
            if i.op in ("dt", "ddt", "gc"):
                new[i.dst] = inputs[i.op][i.a]
            elif i.op == "const":
                new[i.dst] = i.c
            elif i.op in BINARY:
                new[i.dst] = BINARY[i.op](registers[i.a], registers[i.b])
            elif i.op in WITH_CONSTANT:
                new[i.dst] = WITH_CONSTANT[i.op](registers[i.a], i.c)
            elif i.op == "neg":
                new[i.dst] = -registers[i.a]
            else:
                assert not np.isnan(registers[i.b]), f"{i.op}({i.a}) stores a register never written"
                stored[i.op][i.a] = registers[i.b] * i.c
        for r, v in new.items():
            registers[r] = v
    return stored


class Program:
    """A spec's coefficients as float64 functions of its durations (the reference)."""

    def __init__(self, spec: ts.KernelSpec):
        code = lowered(spec)
        self.coefs = code.coefs
        self.dt_symbols = list(self.coefs.dt_syms)
        self.quantities: dict[sp.Symbol, sp.Expr] = {}  # the operator's program quantities, over dt
        for s, e in code.op.program:
            self.quantities[s] = expand_formulas(e).xreplace(self.quantities)

        self.functions: dict[tuple[int, ...], object] = {}

    def values(self, slots: list[int], dt: np.ndarray) -> np.ndarray:
        """The coefficients of ``slots`` at durations dt (complex: a complex step)."""
        key = tuple(slots)
        if key not in self.functions:
            exprs = [expand_formulas(self.coefs.value(q)).xreplace(self.quantities) for q in slots]
            self.functions[key] = sp.lambdify(self.dt_symbols, exprs, "numpy")
        return np.array([complex(v) for v in self.functions[key](*dt)])


@pytest.mark.parametrize("overrides", TAPED, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_tapes_store_the_coefficients_and_their_derivatives(overrides):
    spec = spec_of(overrides)
    program = Program(spec)
    coefs = program.coefs
    assert coefs.taped and len(coefs.lines) > TAPE_ABOVE_LINES
    n = len(program.dt_symbols)
    rng = np.random.default_rng(0)
    dt = 0.05 + 0.1 * rng.random(n)
    direction = rng.standard_normal(n)

    value = run_by_levels(coefs.tape("value"), {"dt": dt})["C"]
    assert set(coefs.straight) <= set(value)
    slots = sorted(value)
    expected = program.values(slots, dt).real
    np.testing.assert_allclose([value[q].real for q in slots], expected, rtol=1e-13, atol=1e-13 * abs(expected).max())

    tangent = run_by_levels(coefs.tape("tangent"), {"dt": dt, "ddt": direction})
    assert sorted(tangent["C"]) == slots and sorted(tangent["CD"]) == slots
    stepped = program.values(slots, dt + 1j * STEP * direction).imag / STEP
    np.testing.assert_allclose([tangent["CD"][q].real for q in slots], stepped, rtol=1e-12,
                               atol=1e-12 * abs(stepped).max())

    # reverse: each straight slot's gradient, plus those of the copies of it
    gc = rng.standard_normal(coefs.size)
    gdt = run_by_levels(coefs.tape("reverse"), {"dt": dt, "gc": gc})["GDT"]
    assert sorted(gdt) == list(range(n))
    seeds = {q: gc[q] for q in coefs.straight}
    for c in range(len(coefs.names), coefs.size):
        if coefs.source(c) in seeds:
            seeds[coefs.source(c)] += gc[c]
    straight = sorted(seeds)
    weights = np.array([seeds[q] for q in straight])
    expected = np.array([weights @ (program.values(straight, dt + 1j * STEP * np.eye(n)[i]).imag / STEP)
                         for i in range(n)])
    np.testing.assert_allclose([gdt[i].real for i in range(n)], expected, rtol=1e-12, atol=1e-12 * abs(expected).max())


class _Row:
    """A row tape's view of an array: index a is the array's ``base + a``."""

    def __init__(self, values: np.ndarray, base: int):
        self.values, self.base = values, base

    def __getitem__(self, a: int) -> complex:
        return self.values[self.base + a]


#: per-step stencils whose rows' reverse programs are row tapes: with a straight-line part as a
#: tape, and as code
ROW_TAPED = [TAPED[0], dict(difference="central", dt="per_step", horizon=24)]


@pytest.mark.parametrize("overrides", ROW_TAPED, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_row_tapes_store_each_rows_coefficients_and_their_derivatives(overrides):
    """On CUDA a run of long rows runs its programs as row tapes (a warp per row, its lanes sharing
    a level): every row of the run, run level by level, stores its slots' values (the value tape),
    with their dt tangents (the tangent tape), and adds to the dt gradient what the run's slots'
    gradients give (the reverse tape), against the operator's coefficients evaluated by SymPy (a
    complex step for the derivatives)."""
    from tensorstep.codegen.coefficients import BARRIER, ROW_TAPE_ABOVE_LINES
    from tensorstep.codegen.statements import RunTape

    spec = spec_of(overrides)
    program = Program(spec)
    coefs = program.coefs
    n = len(program.dt_symbols)
    rng = np.random.default_rng(1)
    dt = 0.05 + 0.1 * rng.random(n)
    direction = rng.standard_normal(n)
    gc = rng.standard_normal(coefs.size)
    tapes = {p: coefs.row_tapes(p) for p in ("value", "tangent", "reverse")}
    assert tapes["value"] and all(len(coefs.runs[k].lines) > ROW_TAPE_ABOVE_LINES for k in tapes["value"])
    # a barrier after each row tape's rows: the next one's warps reuse the kernel's registers
    for statements in (coefs.preamble(as_tapes=True), coefs.tangent_preamble(as_tapes=True)):
        runs = [i for i, st in enumerate(statements) if isinstance(st, RunTape) and st.tape.row]
        assert runs and all(statements[i + 1] == BARRIER for i in runs)
    for k, run in enumerate(coefs.runs):
        if k not in tapes["value"]:
            continue
        assert all(tapes[p][k].row == (run.lo, run.width, run.first) for p in tapes)
        value, tangent, gdt = {}, {}, np.zeros(n)
        for r in range(run.first, run.last + 1):
            slot = run.lo + run.width * (r - run.first)
            stored = run_by_levels(tapes["value"][k], {"dt": _Row(dt, r)})
            assert sorted(stored["C"]) == list(range(run.width)) and not stored["CD"] and not stored["GDT"]
            value.update({slot + i: v for i, v in stored["C"].items()})
            stored = run_by_levels(tapes["tangent"][k], {"dt": _Row(dt, r), "ddt": _Row(direction, r)})
            assert sorted(stored["CD"]) == list(range(run.width))
            tangent.update({slot + i: v for i, v in stored["CD"].items()})
            stored = run_by_levels(tapes["reverse"][k], {"dt": _Row(dt, r), "gc": _Row(gc, slot)})
            assert not stored["C"] and not stored["CD"]
            for a, v in stored["GDT"].items():
                gdt[r + a] += v.real
        slots = list(range(run.lo, run.lo + run.width * (run.last - run.first + 1)))
        assert sorted(value) == sorted(tangent) == slots
        expected = program.values(slots, dt).real
        np.testing.assert_allclose([value[q].real for q in slots], expected, rtol=1e-13, atol=1e-13 * abs(expected).max())
        stepped = program.values(slots, dt + 1j * STEP * direction).imag / STEP
        np.testing.assert_allclose([tangent[q].real for q in slots], stepped, rtol=1e-12, atol=1e-12 * abs(stepped).max())
        expected = np.array([gc[slots] @ (program.values(slots, dt + 1j * STEP * np.eye(n)[i]).imag / STEP)
                             for i in range(n)])
        np.testing.assert_allclose(gdt, expected, rtol=1e-12, atol=1e-12 * abs(expected).max())


def test_short_rows_stay_code():
    """An integrator's rows (a few lines each) keep their programs as code: no row tape."""
    coefs = lowered(spec_of(dict(control="jerk", integrator="exact", dt="per_step", horizon=24))).coefs
    assert coefs.runs and not any(coefs.row_tapes(p) for p in ("value", "tangent", "reverse"))


def test_each_tape_extends_its_own_copy_of_the_program_graph():
    """The value program is read once (tape.graph) and each tape extends a copy of it: a tape made
    after the others is the one made alone from the statements."""
    from tensorstep.codegen import tape

    coefs = lowered(spec_of(TAPED[2])).coefs
    statements = coefs._straight_values(taped=True)
    graph, n_dt = tape.graph(statements), len(coefs.dt_syms)
    for name in ("reverse", "tangent", "value", "reverse"):
        assert tape.build(name, graph, name, n_dt) == tape.build(name, statements, name, n_dt)


def test_short_programs_stay_code():
    """A short program is straight-line code (a tape's loop would cost more than it saves)."""
    short = lowered(spec_of(dict(difference="central", dt="per_step", horizon=40))).coefs
    assert len(short.lines) <= TAPE_ABOVE_LINES and not short.long and not short.taped


@pytest.mark.parametrize("overrides", [dict(control="bspline", degree=4, knots=4, steps=12, end="goal"),
                                       dict(control="bspline", degree=4, knots=4, steps=12, dt="per_trajectory"),
                                       dict(difference="central", horizon=16),
                                       dict(control="jerk", horizon=16, dt="per_trajectory")],
                         ids=["bspline", "bspline-per-trajectory", "position", "jerk-per-trajectory"])
def test_single_dt_programs_are_monomials_on_every_target(overrides):
    """With one dt (uniform, or one per trajectory) every slot is c·dt^p, and C and CUDA run the
    table's programs as loops over its monomials (codegen/monomials.py): no tape, no straight-line
    program. Uniform: each block of a CUDA per-element kernel computes its table in shared memory,
    its threads sharing the slots, with no launch to fill a table (the table kernel, one such
    block, fills one for tables too large to share). Per trajectory: C fills each
    trajectory's table in its loop over the batch; CUDA keeps no table, each thread of a per-element
    kernel computing its coefficients from its trajectory's dt (no table kernel, no table). The dt
    gradient: C finishes it a run at a time, CUDA with one dt a block (the reverse program); with a
    dt per trajectory each thread of CUDA's dt_vjp adds its terms times their coefficients' dt
    derivatives (no sums per coefficient, no reverse program), which a thread per trajectory casts."""
    spec = spec_of(overrides)
    code = lowered(spec)
    assert code.coefs.form == "monomials"
    assert code.coefficient_lines == ["TS_MONOMIALS_VALUE();"]
    assert code.dt_jvp.preamble == ["TS_MONOMIALS_TANGENT();"]
    assert code.dt_vjp_finish.body == ["TS_MONOMIALS_REVERSE();"]
    generated = generate(spec, targets=("c", "cuda"))
    c, cuda = generated.source("c"), generated.source("cuda")
    assert "TS_TAPE_" not in c + cuda and generated.metadata["coefficients"] == "monomials"
    assert "TS_MONOMIALS_VALUE();" in c and "TS_MONOMIALS_REVERSE();" in c
    per_trajectory = spec.dt == "per_trajectory"
    assert ("TS_MONOMIALS_REVERSE();" in cuda) != per_trajectory
    assert ("TS_MONOMIALS_VALUE();" in cuda) != per_trajectory
    assert (f"void {spec.name}_coefficients(" in cuda) != per_trajectory
    B = 5
    plan = generated.launch_plan("cuda")
    nc = generated.n_coefficients
    fills = [(l.kernel, l.grid, l.block) for l in plan.launches("forward", B).launches if l.kernel != "forward"]
    shared = nc * (4 if spec.dtype == "float32" else 8) <= 16384  # small enough for a block's shared memory
    assert fills == ([] if per_trajectory or shared else [("coefficients", 1, 256)])
    launches = plan.launches("dt_vjp_finish", B).launches  # blocks of 256, whatever the batch: one run, or 5 threads
    assert [(launch.kernel, launch.grid, launch.block) for launch in launches] == [("dt_vjp_finish", 1, 256)]
    assert plan.dt_vjp_size(B) == (B if per_trajectory else plan.dt_vjp_rows(B) * plan.dt_vjp_stride(B))
    # dt_vjp: a stencil's reads no table; an integrator's block or threads compute theirs where it fits
    dt_fills = [l.kernel for l in plan.launches("dt_vjp", B).launches if l.kernel != "dt_vjp"]
    assert dt_fills == (["coefficients"] if generated.table.values and not (per_trajectory or shared) else [])


def test_tape_sources_name_each_tape_once():
    """Each target's source holds each tape it runs once, and runs it where its program was: a
    C library's dt_vjp fills its own table, a CUDA dt module's reads the core module's."""
    spec = spec_of(TAPED[0])
    for target in ("c", "cuda"):
        core, dt = (generate(spec, targets=(target,), parts=(p,)).source(target, p) for p in ("core", "dt"))
        # CUDA runs the interior rows as row tapes (C as code: compiled rows are faster than a tape)
        rows = (lambda name: [name, f"{name}_rows0"]) if target == "cuda" else (lambda name: [name])
        assert re.findall(r"const ts_instr \w+_tape_(\w+)\[", core) == rows("value")
        assert "TS_TAPE_TANGENT" not in core and "TS_TAPE_REVERSE" not in core
        own_table = ["value"] if target == "c" else []
        assert re.findall(r"const ts_instr \w+_tape_(\w+)\[", dt) == [*own_table, *rows("tangent"), *rows("reverse")]
        for name in ("tangent", "reverse"):
            assert dt.count(f"TS_TAPE_{name.upper()}();") == 1
            # its macro, and its run where its program's rows were
            assert dt.count(f"TS_TAPE_{name.upper()}_ROWS0(") == (2 if target == "cuda" else 0)


def _reference(spec, dt: np.ndarray, x: Inputs) -> np.ndarray:
    return np.asarray(reference.apply(spec, dt.tolist(), x.numpy_u_bhd(), x.numpy_start()))


def test_taped_per_step_stencil_matches_the_reference():
    """Forward, dt gradient and dt tangent of a per-step stencil of order 4 whose programs are
    tapes, through the C kernels, the Python path and the CUDA source run on the host, against
    the float64 reference and its finite differences (B-splines with tapes: test_dt_stencils.py)."""
    spec = spec_of({**TAPED[0], "horizon": 24})
    assert lowered(spec).coefs.taped
    x = Inputs(spec, batch=3)
    dt = 0.05 + 0.1 * np.random.default_rng(3).random(spec.horizon)
    expected = _reference(spec, dt, x)
    rng = np.random.default_rng(4)
    direction = rng.standard_normal(spec.horizon)
    eps = 1e-6
    f = lambda e: _reference(spec, dt + e * direction, x)
    tangent = (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)
    gs = rng.standard_normal(expected.shape)
    for name, step in kernel_paths(spec):
        dt_t = torch.tensor(dt, requires_grad=True)
        outs = step(x.u, x.p0, x.v0, x.a0, dt_t, **x.kwargs())
        got = np.stack([to_bhd(y, spec) for y in outs])
        scale_close(got, expected, 1e-11)
        weights = [torch.tensor(g if spec.layout == "bhd" else g.transpose(0, 2, 1)) for g in gs]
        (gdt,) = torch.autograd.grad(outs, [dt_t], weights)
        assert np.isclose(gdt.numpy() @ direction, (gs * tangent).sum(), rtol=1e-6), name
        with fwAD.dual_level():
            dual = fwAD.make_dual(torch.tensor(dt), torch.tensor(direction))
            touts = [fwAD.unpack_dual(y).tangent for y in step(x.u, x.p0, x.v0, x.a0, dual, **x.kwargs())]
        scale_close(np.stack([to_bhd(t, spec) for t in touts]), tangent, 1e-6)


@pytest.mark.parametrize("overrides", [TAPED[0], TAPED[1], dict(difference="central", dt="per_step", horizon=40)],
                         ids=["central-order4", "backward-accuracy3", "central"])
def test_rows_of_a_reverse_phase_add_to_distinct_durations(overrides):
    """A per-step reverse program's rows run in phases (codegen/coefficients.py RowRun.phases), whose
    rows a CUDA block's threads share: no two rows of a phase add to the same duration's gradient
    (no race), and every row of a run is in exactly one phase; a barrier ends each phase. A row
    tape's phase is its macro's call over the phase's rows, its stores the durations it adds to."""
    from tensorstep.codegen.statements import Call, For, Read, RunTape, Var, walk

    coefs = lowered(spec_of(overrides)).coefs
    phases = [s for row_tapes in (False, True)  # C's program, and CUDA's (its long rows row tapes)
              for s in coefs.reverse_program(as_tapes=row_tapes) if isinstance(s, For) and s.var == "ph"]
    assert len(phases) == 2 * len(coefs.runs) > 0
    n = len(coefs.runs)
    assert [isinstance(o.body[0], RunTape) for o in phases] == [False] * n + [k in coefs.row_tapes("reverse")
                                                                            for k in range(n)]
    for run, outer in zip(coefs.runs * 2, phases):
        rows, barrier = outer.body
        if isinstance(rows, RunTape):
            first, last, step = rows.args
            assert last == run.last and rows.tape.row == (run.lo, run.width, run.first)
            offsets = [i.a for i in rows.tape.instructions if i.op == "GDT"]
        else:
            first, step = rows.first, rows.step
            assert rows.shared
            offsets = [n.args[0].rel for n in walk(rows.body) if isinstance(n, Read) and n.macro == "GDT"]
        assert first == Var(f"{run.first} + ph") and barrier == Call("TS_BARRIER")
        assert len(offsets) > 1
        covered = []
        for ph in range(outer.first, outer.last + 1):
            phase = range(run.first + ph, run.last + 1, step)
            durations = [r + o for r in phase for o in offsets]
            assert len(durations) == len(set(durations)), ph
            covered += phase
        assert sorted(covered) == list(range(run.first, run.last + 1))
