"""Every stage of the code generator can be seen: ``generate(..., keep=True)`` and `tensorstep show
--stage operator|lowered|c|cuda`. Codegen only (no PyTorch here)."""
from __future__ import annotations

import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import sympy as sp
from click.testing import CliRunner

import tensorstep
from tensorstep.cli import main
from tensorstep.codegen.driver import FORMS, generate
from tensorstep.codegen.spec import KernelSpec

ROOT = Path(tensorstep.__file__).resolve().parent
SPECS = {  # a position spec, an integrator (a recurrence), a B-spline
    "position": dict(horizon=8, dof=2, difference="backward", accuracy=2),
    "integrator": dict(horizon=7, dof=3, control="acceleration", dt="per_step"),
    "bspline": dict(control="bspline", degree=3, knots=4, steps=2, dof=1, end="goal"),
}
NAMES = "PVAJS"


def show(*args: str):
    return CliRunner().invoke(main, ["show", *args])


def options(overrides: dict) -> list[str]:
    return [x for k, v in overrides.items() for x in (f"--{k}", str(v))]


def backward_weights(derivative: int, points: int) -> list[Fraction]:
    """Weights w_i of f^(d)(0) ≈ Σ w_i f(-i) / dt^d, i = 0..points-1: the Taylor conditions
    Σ w_i (-i)^m / m! = [m == d], m < points, solved exactly (Gauss-Jordan over fractions)."""
    rows = [[Fraction((-i) ** m, sp.factorial(m)) for i in range(points)] + [Fraction(int(m == derivative))]
            for m in range(points)]
    for c in range(points):
        pivot = next(r for r in range(c, points) if rows[r][c] != 0)
        rows[c], rows[pivot] = rows[pivot], rows[c]
        rows[c] = [x / rows[c][c] for x in rows[c]]
        for r in range(points):
            if r != c and rows[r][c] != 0:
                rows[r] = [a - rows[r][c] * b for a, b in zip(rows[r], rows[c])]
    return [rows[i][-1] for i in range(points)]


def test_backward_weights_reference():
    """The reference itself, against the textbook second-order stencils."""
    assert backward_weights(1, 3) == [Fraction(3, 2), Fraction(-2), Fraction(1, 2)]
    assert backward_weights(2, 4) == [2, -5, 4, -1]


def parse_rows(text: str) -> dict[str, sp.Expr]:
    """The printed operator's rows, 'V[3]' → the right-hand side over symbols u_j, p0, ..."""
    rows = {}
    for line in text.splitlines():
        if not line.startswith("#") and "=" in line:
            left, right = line.split(" = ")
            rows[left] = sp.sympify(re.sub(r"(\w+)\[(\d+)\]", r"\1_\2", right), locals={"S": sp.Symbol("S")})
    return rows


@pytest.mark.parametrize("accuracy", [1, 2, 3])
def test_operator_of_a_backward_difference_is_its_stencil(accuracy):
    """Interior rows (whose stencil reads actions only): derivative k of row h is
    Σ_i w_i u[h-1-i] / dt^k with the exact backward-difference weights, as printed and as kept."""
    H = 10
    spec = KernelSpec(horizon=H, dof=1, difference="backward", accuracy=accuracy)
    result = show(*options(dict(horizon=H, dof=1, difference="backward", accuracy=accuracy)), "--stage", "operator")
    assert result.exit_code == 0, result.output
    rows = parse_rows(result.output)
    assert set(rows) == {f"{NAMES[k]}[{h}]" for k in range(4) for h in range(H)}
    dt = sp.Symbol("dt")
    u = sp.symbols(f"u_0:{H - 1}")
    for k in (1, 2, 3):
        w = backward_weights(k, k + accuracy)
        for h in range(len(w), H):
            expected = sum(sp.Rational(c.numerator, c.denominator) * u[h - 1 - i] for i, c in enumerate(w)) / dt ** k
            assert sp.simplify(rows[f"{NAMES[k]}[{h}]"].subs(sp.Symbol("dt", positive=True), dt) - expected) == 0, (k, h)
    kept = generate(spec, targets=("c",), parts=("core",), keep=True).stages.operator
    row = next(r for r in kept.rows if (r.k, r.h) == (1, H - 1))
    weights = {ref[1]: sp.nsimplify(c * kept.dt_symbols[0]) for c, ref in row.terms}
    assert weights == {H - 2 - i: sp.Rational(c.numerator, c.denominator) for i, c in enumerate(backward_weights(1, 1 + accuracy))}


@pytest.mark.parametrize("name", SPECS)
def test_operator_stage_lists_every_row_once(name):
    g = generate(KernelSpec(**SPECS[name]), targets=("c",), parts=("core",), keep=True)
    text = g.stages.text("operator")
    assert text.startswith(f"# operator {g.spec.name}: outputs P, V, A, J over {g.spec.horizon} rows")
    lefts = [line.split(" = ")[0] for line in text.splitlines() if not line.startswith("#")]
    rows = [f"{NAMES[k]}[{h}]" for k in range(4) for h in range(g.spec.horizon)]
    assert sorted(left for left in lefts if left in rows) == sorted(rows)
    assert len(lefts) == len(rows) + len(g.stages.operator.program)


@pytest.mark.parametrize("name", SPECS)
def test_lowered_stage_has_each_kernel_and_every_output_store(name):
    spec = KernelSpec(**SPECS[name])
    result = show(*options(SPECS[name]), "--stage", "lowered")
    assert result.exit_code == 0, result.output
    text = result.output
    recurrence = name == "integrator"
    assert text.startswith(f"# lowered {spec.name}: a {'recurrence' if recurrence else 'stencil'}; ")
    sections = re.findall(r"^# (\w+)$", text, re.M)
    assert sections == ["forward", "adjoint", "dt_vjp", "dt_vjp_finish", "dt_jvp"]
    forward = text.split("\n# forward\n")[1].split("\n# adjoint\n")[0]
    loops = re.findall(r"^  for r in \[(\d+), (\d+)\), output row r:\n((?:    .*\n)*)", forward + "\n", re.M)
    for k in range(4):  # each output row stored once: by the statements (Yk(h, ...)) or by a loop over r
        stored = [int(h) for h in re.findall(rf"\bY{k}\((\d+), ", forward)]
        for first, stop, body in loops:
            if re.search(rf"\bSY{k}\b", body):
                stored += range(int(first), int(stop))
        assert sorted(stored) == list(range(spec.horizon)), k


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("target", ["c", "cuda"])
def test_source_stages_are_the_generated_sources(name, target):
    spec = KernelSpec(**SPECS[name])
    for part in ("core", "dt"):
        want = generate(spec, targets=(target,), parts=(part,)).source(target, part)
        assert generate(spec, targets=(target,), parts=(part,), keep=True).stages.text(target) == want
        result = show(*options(SPECS[name]), "--stage", target, "--kernel", part)
        assert result.exit_code == 0, result.output
        assert result.output.endswith(want + "\n")  # after a B-spline's derivation comment


@pytest.mark.parametrize("target, extension", [("c", "c"), ("cuda", "cu")])
def test_show_stage_of_a_config_is_what_generate_writes(target, extension):
    """`show CONFIG --stage c` prints each kernel's source as `tensorstep generate` wrote it to generated/."""
    from tensorstep.config import load_config

    config = ROOT / "examples" / "mobile_manipulator.yml"
    written = [(ROOT / "generated" / "mobile_manipulator" / f"{s.name}.{extension}").read_text()
               for s in load_config(str(config)).specs]
    result = show(str(config), "--stage", target)
    assert result.exit_code == 0, result.output
    assert result.output == "".join(text + "\n" for text in written)


def test_keep_is_off_by_default_and_forms_are_checked():
    spec = KernelSpec(horizon=6, dof=2)
    assert generate(spec, targets=("c",), parts=("core",)).stages is None
    stages = generate(spec, targets=("c",), parts=("core", "dt"), keep=True).stages
    assert FORMS == ("operator", "lowered", "c", "cuda", "header")
    with pytest.raises(ValueError, match=r"form='c': allowed operator, lowered, c, cuda, header with one part"):
        stages.text("c")  # two parts generated
    with pytest.raises(ValueError, match=r"form='cuda'"):
        stages.text("cuda")  # not generated


@pytest.mark.parametrize("args, fragment", [
    (("--stage", "source"), "Invalid value for '--stage': 'source' is not one of 'operator', 'lowered', 'c', 'cuda'"),
    (("--stage", "c", "--target", "cuda"), "error: --stage c prints the c source: it cannot be combined with --target cuda"),
])
def test_bad_stage_is_a_click_error(args, fragment):
    result = show("--horizon", "6", "--dof", "2", *args)
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output  # no traceback
    assert fragment in result.output and "Traceback" not in result.output


def test_without_stage_show_prints_the_target_source():
    """No --stage: --target's source, as before; --stage c with --target c is the same."""
    spec = KernelSpec(horizon=6, dof=2)
    for target in ("c", "header"):
        want = generate(spec, targets=(target,)).source(target) + "\n"
        assert show("--horizon", "6", "--dof", "2", "--target", target).output == want
    assert show("--horizon", "6", "--dof", "2", "--stage", "c", "--target", "c").output == \
        generate(spec, targets=("c",)).source("c") + "\n"


@pytest.mark.parametrize("stage", ["operator", "lowered"])
def test_show_stage_imports_no_torch(stage):
    code = ("import sys; from tensorstep.cli import main\n"
            f"main(['show', '--horizon', '8', '--dof', '2', '--stage', '{stage}'], standalone_mode=False)\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"# {stage} ts_h8_d2_")


def _macros_used(code, setup: bool = True) -> set[str]:
    """Every macro the lowered kernels read or call (column form), over each kernel's variants
    (``setup``: with the per-element kernels' setup, which CUDA runs in a kernel of its own)."""
    from tensorstep.codegen.statements import Call, Read, walk

    kernels = [code.forward, code.adjoint, code.gathered_adjoint, code.dt_vjp, code.dt_vjp_finish, code.dt_jvp,
               code.adjoint_reads, code.forward_rolled, code.adjoint_rolled]
    nodes = []
    for k in kernels:
        if k is None:
            continue
        if isinstance(k, list):  # a rolled column: statements
            nodes.append(tuple(k))
            continue
        nodes += [tuple(k.setup) if setup or k is code.dt_vjp_finish else (), tuple(k.statements)]
        nodes += [tuple(s) for loop in k.loops for s in (loop.statements, loop.init, loop.finish)]
    return {n.macro for n in walk(tuple(nodes)) if isinstance(n, (Read, Call))}


@pytest.mark.parametrize("case", [*SPECS, "goal_indexed", "per_trajectory"])
def test_every_macro_the_statements_use_is_defined_by_each_template(case):
    """The lowering names macros (``G0``, ``GS1``, ``ACC``, ...) that the templates define; a name
    one side spells differently is found here, by name, rather than as a C compile error."""
    overrides = {**SPECS, "goal_indexed": dict(horizon=8, dof=2, end="goal", goal_index=True, start_index=True),
                 "per_trajectory": dict(horizon=9, dof=2, control="jerk", dt="per_trajectory")}[case]
    g = generate(KernelSpec(**overrides), targets=("c", "cuda"), keep=True)
    assert {"U", "GU", "G0", "Y0", "S0", "GS0"} <= _macros_used(g.stages.lowered)  # the walk sees the statements
    for target in ("c", "cuda"):
        used = _macros_used(g.stages.lowered, setup=target == "c")
        defined = set(re.findall(r"^\s*#define\s+(\w+)", g.source(target), re.M))
        assert used - defined == set(), target
