"""codegen/reads.py: CUDA's straight-line stencil columns with each input read once. The statements
before and after are run by a small interpreter over Python floats (IEEE doubles, no fused
multiply-add), every table coefficient and input a random number: the same stores with the same
values, bit for bit, and each input read once. Codegen only (no PyTorch here)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from tensorstep.codegen import reads
from tensorstep.codegen.driver import lowered
from tensorstep.codegen.spec import KernelSpec
from tensorstep.codegen.statements import (Call, Def, For, Paren, Read, Store, Sum, Term, Val, Var, walk)

#: wide stencils of order 4 with a dt per step (their adjoints spilled at CUDA's register cap), a
#: uniform one, a one-sided one with span loops, a B-spline
SPECS = [
    dict(horizon=32, difference="backward", accuracy=3, dt="per_step", order=4),
    dict(horizon=64, difference="central", accuracy=8, dt="per_step", order=4),
    dict(horizon=32, difference="central", accuracy=4, dt="per_step", order=4),
    dict(horizon=16, difference="central", accuracy=(2, 4, 2)),
    dict(horizon=12, difference="central", end="one_sided", accuracy=6, start_index=True),
    dict(control="bspline", degree=4, knots=10, steps=4),  # stores between span loops: runs of them
    # 2 rows a span: the start state's and the first actions' stores on either side of the knots' loop
    dict(control="bspline", degree=4, knots=32, steps=2, dt="per_trajectory"),
]


def run(lines) -> dict:
    """What the statements store (macro and arguments → value); a read is a random number fixed by
    its macro and arguments (so both forms read the same inputs)."""
    env: dict = {}
    stored: dict = {}

    def read(node: Read) -> float:
        return random.Random(repr((node.macro, node.args))).uniform(-1, 1)

    def value(node) -> float:
        if isinstance(node, Read):
            return read(node)
        if isinstance(node, (Var, Val)):
            return env[node]
        if isinstance(node, Paren):
            return value(node.x)
        if isinstance(node, Sum):
            total = None
            for t in node.terms:
                x = value(t.operand) if t.factor is None else value(t.factor) * value(t.operand)
                x = -x if t.negative else x
                total = x if total is None else total + x
            return 0.0 if total is None else total
        raise AssertionError(f"not interpreted: {node!r}")

    for line in lines:
        if isinstance(line, Def):
            assert line.target not in env, f"{line.target} defined twice"
            env[line.target] = value(line.value)
        elif isinstance(line, Store):
            assert line.op == "+=" and isinstance(line.target, Var)
            env[line.target] = env[line.target] + value(line.value)
        elif isinstance(line, Call):
            key = (line.macro, line.args)
            assert key not in stored, f"{key} stored twice"
            stored[key] = value(line.value)
        else:
            assert isinstance(line, For)  # interior loops are not reordered
    return stored


def operand_reads(lines, prefix: str) -> Counter:
    return Counter((n.macro, n.args) for line in lines if not isinstance(line, For) for n in walk(line)
                   if isinstance(n, Read) and n.macro.startswith(prefix))


def spec_of(overrides: dict) -> KernelSpec:
    return KernelSpec(dof=7, dtype="float32", **overrides)


@pytest.mark.parametrize("overrides", SPECS, ids=lambda o: spec_of(o).name)
def test_adjoint_stores_in_read_order_are_the_same_sums(overrides):
    written = lowered(spec_of(overrides)).adjoint_reads.statements
    ordered = reads.in_read_order(written)
    assert run(ordered) == run(written)  # the same additions in the same order: equal floats
    before, after = operand_reads(written, "G"), operand_reads(ordered, "G")
    assert set(after) == set(before) and max(before.values()) > 1  # the sums as written share reads
    if not any(isinstance(line, For) for line in written):
        assert set(after.values()) == {1}, "each output gradient is read once"
    else:  # loops between (span loops): each read once between two loops
        assert sum(after.values()) < sum(before.values())
    assert any(isinstance(line, Store) for line in ordered)


@pytest.mark.parametrize("overrides", [SPECS[-2], SPECS[-1]], ids=lambda o: spec_of(o).name)
def test_no_value_loaded_ahead_of_a_loop_is_read_after_it(overrides):
    """A run of stores after a loop loads the output gradients it reads again (under new names)
    rather than read the locals a run before the loop loaded: none of them is live through it."""
    ordered = reads.in_read_order(lowered(spec_of(overrides)).adjoint_reads.statements)
    loops = [i for i, line in enumerate(ordered) if isinstance(line, For)]
    assert loops
    loaded = lambda lines: {line.target for line in lines if isinstance(line, Def) and isinstance(line.value, Read)
                            and line.value.macro.startswith("G") and line.value.args}
    for i in loops:
        used_after = {n for line in ordered[i + 1:] for n in walk(line) if isinstance(n, Var)}
        assert not loaded(ordered[:i]) & used_after
    if overrides.get("steps") == 2:  # some gradients are read on both sides of the knots' loop
        assert any(operand_reads(ordered[:i], "G").keys() & operand_reads(ordered[i + 1:], "G").keys() for i in loops)


@pytest.mark.parametrize("overrides", SPECS[:3], ids=lambda o: spec_of(o).name)
def test_tangent_reads_once(overrides):
    written = lowered(spec_of(overrides)).dt_jvp.statements
    once = reads.loaded_once(written)
    assert run(once) == run(written)
    before, after = operand_reads(written, "DU"), operand_reads(once, "DU")
    assert max(before.values()) > 1 and set(after) == set(before) and set(after.values()) == {1}
    # each is loaded right before the first statement that uses it (after the other loads there)
    load = lambda line: isinstance(line, Def) and isinstance(line.value, Read) and line.value.args
    for i, line in enumerate(once):
        if load(line):
            user = next(x for x in once[i + 1:] if not load(x))
            assert line.target in set(walk(user)), (line, user)


def test_stores_whose_sums_order_reads_differently_stay_as_written():
    g = lambda h: Read("G0", (h,))
    c = lambda q: Read("C", (q,))
    crossed = [Call("GU", (0,), Sum((Term(c(0), g(1)), Term(c(1), g(2))))),
               Call("GU", (1,), Sum((Term(c(2), g(2)), Term(c(3), g(1)))))]
    assert reads.in_read_order(crossed) == crossed
    twice = [Call("GU", (0,), Sum((Term(c(0), g(1)), Term(c(1), g(1)))))]
    assert reads.in_read_order(twice) == twice
    # a sum that adds anything but output gradients and locals
    mixed = [Call("GU", (0,), Sum((Term(c(0), g(1)), Term(c(1), Read("U", (1,))))))]
    assert reads.in_read_order(mixed) == mixed
    # a local (a span loop's sum) is added in its place
    local = [Call("GU", (0,), Sum((Term(c(0), g(1)), Term(None, Var("au0")), Term(c(1), g(2))))),
             Call("GU", (1,), Sum((Term(c(2), g(1)), Term(c(3), g(2)))))]
    ordered = reads.in_read_order(local)
    assert ordered != local and operand_reads(ordered, "G") == {("G0", (1,)): 1, ("G0", (2,)): 1}
    assert run([Def(Var("au0"), Read("A"))] + ordered) == run([Def(Var("au0"), Read("A"))] + local)
