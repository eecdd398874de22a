"""Cost kinds (codegen/costs.py): each kind's SymPy expression is its definition, and the derivatives
SymPy takes of it are the derivatives (against the NumPy reference and central differences). Codegen
only: no PyTorch."""
from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

import reference_costs
from tensorstep.codegen.costs import KINDS, LOWER, MARGIN, TARGET, UPPER, W, Y, CostKind
from tensorstep.codegen.spec import KernelSpec

RNG = np.random.default_rng(0)
POINTS = RNG.uniform(-3, 3, 64)  # y, around and beyond the limits below
PARAMS = {W: 0.7, LOWER: -1.0, UPPER: 1.5, MARGIN: 0.2, TARGET: 0.4}


def _numeric(expr: sp.Expr):
    return sp.lambdify([Y], expr.subs(PARAMS).replace(
        lambda x: isinstance(x, sp.Heaviside), lambda x: sp.Piecewise((1, x.args[0] > 0), (0, True))), "numpy")


@pytest.mark.parametrize("kind", KINDS)
def test_expression_is_the_definition(kind):
    y = POINTS.reshape(1, -1, 1)
    ref = reference_costs.term(kind, y, np.array([PARAMS[W]]), limit=np.array([[PARAMS[LOWER]], [PARAMS[UPPER]]]),
                               margin=np.array([PARAMS[MARGIN]]), target=np.array([[PARAMS[TARGET]]]))
    got = np.sum(_numeric(KINDS[kind].expression)(POINTS))
    np.testing.assert_allclose(got, ref[0], rtol=1e-14)


@pytest.mark.parametrize("kind", KINDS)
def test_derivatives_match_central_differences(kind):
    """Away from the kinks (|y − limit ± margin| > 1e-3), where the second derivative is defined."""
    f, df, d2f = (_numeric(e) for e in (KINDS[kind].expression, KINDS[kind].derivative, KINDS[kind].second_derivative))
    kinks = np.array([PARAMS[LOWER] + PARAMS[MARGIN], PARAMS[UPPER] - PARAMS[MARGIN]])
    y = POINTS[np.min(np.abs(POINTS[:, None] - kinks[None, :]), axis=1) > 1e-3]
    h = 1e-6
    np.testing.assert_allclose(df(y), (f(y + h) - f(y - h)) / (2 * h), rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(d2f(y) * np.ones_like(y), (df(y + h) - df(y - h)) / (2 * h), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("kind", [k for k in KINDS if KINDS[k].narrow])
def test_narrow_forms_are_the_kind_where_their_condition_holds(kind):
    """Values and first derivatives equal on samples where the condition holds (y on both sides of
    and between the limits, margins up to the condition's edge); some differ where it does not."""
    condition, narrow = KINDS[kind].narrow
    rng = np.random.default_rng(2)
    n = 4096
    lower, upper = rng.uniform(-2, 0, n), rng.uniform(0, 2, n)
    samples = {Y: rng.uniform(-4, 4, n), W: rng.uniform(0, 3, n), LOWER: lower, UPPER: upper,
               MARGIN: rng.uniform(0, 1, n) * (upper - lower) / 2, TARGET: rng.uniform(-3, 3, n)}
    args = list(samples)
    numeric = lambda e: sp.lambdify(args, e.replace(
        lambda x: isinstance(x, sp.Heaviside), lambda x: sp.Piecewise((1, x.args[0] > 0), (0, True))),
        [{"DeadZone": lambda y, a, b: y - np.minimum(np.maximum(y, a), b)}, "numpy"])
    holds = numeric(condition)(*samples.values())
    assert holds.all()
    for general, fast in ((KINDS[kind].expression, narrow.expression), (KINDS[kind].derivative, narrow.derivative)):
        np.testing.assert_allclose(numeric(fast)(*samples.values()), numeric(general)(*samples.values()),
                                   rtol=1e-14, atol=1e-14)
    samples[MARGIN] = (upper - lower) * rng.uniform(0.6, 1.5, n)  # lower + margin > upper − margin
    assert not numeric(condition)(*samples.values()).any()
    assert not np.allclose(numeric(narrow.expression)(*samples.values()), numeric(KINDS[kind].expression)(*samples.values()))


@pytest.mark.parametrize("kind", KINDS)
def test_nonnegative_kinds_are_nonnegative(kind):
    """What ``nonnegative`` claims (float32 forwards then add runs of rows in float, which only terms
    that cannot cancel allow), checked on samples: y and every parameter drawn, margins and
    weights ≥ 0, lower > upper too; and a signed kind is not claimed."""
    assert KINDS[kind].nonnegative
    rng = np.random.default_rng(1)
    samples = {Y: rng.uniform(-5, 5, 4096), W: rng.uniform(0, 3, 4096), LOWER: rng.uniform(-3, 3, 4096),
               UPPER: rng.uniform(-3, 3, 4096), MARGIN: rng.uniform(0, 2, 4096), TARGET: rng.uniform(-3, 3, 4096)}
    values = sp.lambdify(list(samples), KINDS[kind].expression, "numpy")(*samples.values())
    assert np.all(values >= 0)
    assert not CostKind("linear", W * (Y - TARGET)).nonnegative
    assert not CostKind("unknown sign", W * Y ** 3).nonnegative


def test_float32_forward_adds_runs_of_rows_float64_every_row():
    """The C float32 forward of a fused step adds a term's rows in runs in float before its double
    sum (codegen/fused.py ``run_rows``); the float64 one adds each row to its double sum, as before;
    the CUDA source keeps every row too. C's entry points choose a bound's narrow form per call, and
    a variant without row weights where they are all 1."""
    from tensorstep.codegen.driver import generate
    from tensorstep.codegen.fused import FLOAT_RUN_ROWS

    costs = (("bound", "velocity"), ("squared", "jerk"))
    for dtype, runs in (("float32", True), ("float64", False)):
        spec = KernelSpec(horizon=20, dof=3, dtype=dtype, costs=costs, outputs=("P",))
        generated = generate(spec, targets=("c", "cuda"), parts=("core",))
        c, cuda = generated.source("c", "core"), generated.source("cuda", "core")
        assert ("crun0" in c) == runs and "crun" not in cuda
        # a bound's narrow form (C only): a batch function of its own, run where every dof allows it
        assert c.count("narrow &= (clo0 + cmar0 <= chi0 - cmar0);") == 2 and "narrow" not in cuda
        assert "_forward_narrow_batch(int64_t" in c and "_adjoint_narrow_batch(int64_t" in c
        # and without row weights where every one is 1: a variant each, with and without the narrow forms
        assert c.count("unit_rows &= (CRW0(h) == 1) && (CRW1(h) == 1);") == 2
        for kernel in ("forward", "adjoint"):
            for form in ("_unit_rows", "_narrow_unit_rows"):
                start = c.index(f"_{kernel}{form}_batch(int64_t")
                body = c[start:c.index("\n}\n", start)]
                assert "CRW" not in body and "cw0" in body
            general = c[c.index(f"_{kernel}_batch(int64_t"):]
            assert "CRW0(" in general[:general.index("\n}\n")]
        if runs:  # the column form: one double sum per run of rows, and one for the last, shorter run;
            # the first run is the accumulator's first value (assigned, not added to its zero)
            column = c[c.index("for (int64_t d = 0; d < D_; ++d)", c.index("_forward_batch(")):]
            column = column[:column.index("CPART(0")]
            assert column.count("cacc0 = (double)") == 1
            assert column.count("cacc0 +=") == -(-20 // FLOAT_RUN_ROWS) - 1


def test_defined_ahead_keeps_the_rows_in_order():
    """``defined_ahead``: every row's definition printed once, in row order, no later than its own
    uses, and those of the rows up to ``steps`` steps (h) ahead before them; 0 steps: each row alone."""
    from types import SimpleNamespace

    from tensorstep.codegen.fused import defined_ahead

    op = SimpleNamespace(rows=[SimpleNamespace(h=h) for h in (0, 0, 1, 1, 2, 2, 3, 3)])
    assert defined_ahead(op, 0) == [(i, i + 1) for i in range(8)]
    assert defined_ahead(op, 1) == [(0, 4), (4, 4), (4, 6), (6, 6), (6, 8), (8, 8), (8, 8), (8, 8)]
    for steps in range(4):
        spans = defined_ahead(op, steps)
        assert [i for first, end in spans for i in range(first, end)] == list(range(8))
        for i, (row, (_, end)) in enumerate(zip(op.rows, spans)):
            assert end > i and all(r.h <= row.h + steps for r in op.rows[:end])
            assert end == 8 or op.rows[end].h > row.h + steps or end == i + 1


def test_c_fused_stencil_columns_define_rows_ahead_cuda_columns_do_not():
    """C's fused stencil columns print the rows of the next ``C_AHEAD`` steps before a row's store,
    cost terms (forward) and gradient (adjoint); CUDA's sources keep each row next to its uses."""
    from tensorstep.codegen.driver import generate
    from tensorstep.codegen.fused import C_AHEAD

    spec = KernelSpec(horizon=12, dof=3, costs=(("bound", "velocity"), ("squared", "jerk")), outputs=("P",))
    generated = generate(spec, targets=("c", "cuda"), parts=("core",))
    c, cuda = generated.source("c", "core"), generated.source("cuda", "core")
    for kernel, use in (("forward", "crun0 += CRW0(5)*("), ("adjoint", "g1_5 = ")):
        start = c.index(f"_{kernel}_batch(int64_t")
        body = c[c.index("#if defined(TS_LANES)", start):c.index("\n}\n", start)]
        ahead = C_AHEAD[kernel]
        assert ahead > 0
        assert body.index(f"const VT y1_{5 + ahead} = ") < body.index(use) < body.index(f"const VT y1_{6 + ahead} = ")
    # CUDA's adjoint (its interior rolled into a loop, where rows are ``y1_c``): each row's gradient
    # is the statement just after the row's own definition
    lines = [line.strip() for line in cuda.splitlines()]
    gradients = [i for i, line in enumerate(lines) if re.match(r"const T g1_\w+ = ", line)]
    assert len(gradients) >= 3 and any(lines[i].startswith("const T g1_c = ") for i in gradients)
    for i in gradients:
        row = re.match(r"const T g1_(\w+) = ", lines[i]).group(1)
        assert lines[i - 1].startswith(f"const T y1_{row} = "), lines[i - 1]


@pytest.mark.parametrize("fields", [dict(), dict(difference="backward", accuracy=2), dict(control="jerk"),
                                    dict(order=4, accuracy=(2, 2, 2, 2)), dict(end="goal")])
def test_paired_rows_are_the_rows(fields):
    """C's fused columns take a row's terms whose coefficients are equal or opposite as one product
    (codegen/fused.py ``pairs``): each group's expansion, summed, is the row itself (SymPy, every row);
    stencils group some terms (an integrator's rows, one term per input, none). In a central stencil's
    interior, a velocity row and a jerk row of the same step read the same differences u[j−2] − u[j+2]
    and u[j−1] − u[j+1]."""
    from tensorstep.codegen.fused import pairs
    from tensorstep.codegen.schemes import build_operator

    spec = KernelSpec(horizon=12, dof=2, costs=(("squared", "velocity"),), outputs=("P",), **fields)
    op = build_operator(spec)
    value = lambda ref: sp.Symbol("_".join(map(str, ref)))
    grouped = 0
    for row in op.rows:
        groups = pairs(row)
        expanded = sum(c * sum((-1 if neg else 1) * value(ref) for ref, neg in refs) for c, refs in groups)
        assert sp.expand(expanded - sum(c * value(ref) for c, ref in row.terms)) == 0, row
        assert sum(len(refs) for _, refs in groups) == len(row.terms) and all(not refs[0][1] for _, refs in groups)
        grouped += sum(len(refs) > 1 for _, refs in groups)
    if not fields:
        by = {(row.k, row.h): {refs for _, refs in pairs(row) if len(refs) > 1} for row in op.rows}
        h = spec.horizon // 2
        j = h - 1  # the action row the step's position is
        assert by[1, h] == by[3, h] == {((("u", j - 2), False), (("u", j + 2), True)),
                                          ((("u", j - 1), False), (("u", j + 1), True))}
    assert (grouped > 0) == (spec.control == "position")


def test_spec_fields_round_trip_and_name_the_terms():
    spec = KernelSpec(horizon=32, dof=7, costs=(("bound", "velocity"), ("squared", "jerk")), outputs=("P",))
    assert KernelSpec.from_dict(spec.to_dict()) == spec
    assert spec.name.endswith("_outp_bv_sj")
    plain = KernelSpec(horizon=32, dof=7)
    assert "costs" not in plain.to_dict() and "outputs" not in plain.to_dict() and plain.outputs == ("P", "V", "A", "J")


@pytest.mark.parametrize("fields, message", [
    (dict(costs=(("bound", "snap"),)), "the state 'snap' needs order=4; the spec's order is 3, "
                                        "which allows position, velocity, acceleration, jerk"),
    (dict(costs=(("bound", "snp"),)), "unknown state 'snp' (allowed: position, velocity, acceleration, jerk)"),
    (dict(costs=("bound", "velocity")), "got 'bound' (one term is given as a tuple of it: "
                                        "costs=(('bound', 'velocity'),))"),
    (dict(costs=(("sqared", "jerk"),)), "did you mean 'squared'"),
    (dict(costs=(("bound", "jerk"), ("bound", "jerk"))), "listed twice"),
    (dict(costs="bound"), "expected a tuple of (kind, state) pairs"),
    (dict(outputs=("P", "X")), "unknown output 'X'"),
    (dict(outputs=("S",)), "the output 'S' needs order=4; the spec's order is 3, which allows P, V, A, J"),
    (dict(outputs=()), "at least one output"),
])
def test_bad_costs_and_outputs_are_named(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        KernelSpec(horizon=8, dof=2, **fields)


def test_cost_keywords_parse_back_to_their_terms():
    """Every keyword the argument table gives a term (each kind on each state) parses back to that term
    (arguments.py ``cost_term_of``: the kinds, states and parameter names are the data's); a
    misspelt parameter still names its term; forward's other arguments name none."""
    from tensorstep.codegen.arguments import cost_term_of, term_keywords, unknown_keyword
    from tensorstep.codegen.spec import COST_KINDS, DERIVATIVE_NAMES

    for kind in COST_KINDS:
        for state in DERIVATIVE_NAMES:
            assert all(cost_term_of(name) == (kind, state) for name in term_keywords(kind, state))
    assert term_keywords("squared", "position")[-1] == "squared_position_target"
    assert cost_term_of("bound_jerk_limt") == ("bound", "jerk")
    assert [cost_term_of(n) for n in ("u", "p0", "j0", "start_index", "goal_index", "dt", "bound_jerk")] == [None] * 7
    # a name that is no cost keyword: the closest allowed, as before
    assert unknown_keyword("p00", ("u", "p0"), ()) == "did you mean 'p0'? allowed: u, p0"


def test_outputs_out_of_order_are_refused():
    """The step returns the written states in P, V, A, J (S) order: outputs given in another order
    would swap them for a caller who unpacks in the order written, so the spec refuses it, naming
    the order expected and the one given; a list in order is kept."""
    expected = "KernelSpec.outputs=('A', 'P') is invalid: give the states in the order the step returns them, " \
               "('P', 'A'); got ('A', 'P')"
    with pytest.raises(ValueError) as err:
        KernelSpec(horizon=8, dof=2, outputs=("A", "P"))
    assert str(err.value) == expected
    with pytest.raises(ValueError, match=r"\('V', 'J'\); got \('J', 'V'\)"):
        KernelSpec(horizon=8, dof=2, costs=(("bound", "jerk"),), outputs=["J", "V"])
    assert KernelSpec(horizon=8, dof=2, order=4, outputs=["P", "A", "S"]).outputs == ("P", "A", "S")


def test_kinds_and_their_parameters_agree_with_the_spec():
    """spec.COST_KINDS (kept without SymPy for the spec's and argument table's checks) names each kind
    of ``KINDS`` with the parameters its expression reads; a target only where the kind has one; and
    the derivatives' unit steps take 0 at 0, as the C kernels' TS_STEP does (SymPy's default is 1/2)."""
    from tensorstep.codegen.spec import COST_KINDS

    assert list(COST_KINDS) == list(KINDS)
    for name, kind in KINDS.items():
        assert COST_KINDS[name] == kind.parameters
        assert (TARGET in kind.expression.free_symbols) == bool(kind.target_states)
        steps = [h for e in (kind.derivative, kind.second_derivative) for h in e.atoms(sp.Heaviside)]
        assert all(h.args[1:] == (0,) for h in steps), steps
    assert KINDS["bound"].second_derivative.atoms(sp.Heaviside)
