"""CUDA's fused float32 and float64 forwards with a knots' loop fence their straight-line spans every few
rows (codegen/targets.py ``CUDA_FENCED_ROWS``, codegen/fences.py ``rows_fenced``): ``TS_FENCE();`` before
each two rows of the first spans and of the last, the loop as it was; C unfenced."""
from __future__ import annotations

import re

import pytest

import tensorstep as ts
from tensorstep.codegen import targets
from tensorstep.codegen.fences import rows_fenced
from tensorstep.codegen.statements import Call, Def, Fence, For, Read, Store, Sum, Term, Val, Var

TERMS = (("bound", "velocity"), ("squared", "jerk"))


def _forward(spec: ts.KernelSpec, target: str = "cuda") -> str:
    source = ts.source(spec, target)
    start = source.index(f"{spec.name}_forward(int64_t B" if target == "cuda" else f"{spec.name}_forward(")
    return source[start:source.index(f"{spec.name}_adjoint(", start)]


def _spec(dtype: str) -> ts.KernelSpec:
    return ts.KernelSpec(control="bspline", degree=3, knots=12, steps=4, dof=2, dtype=dtype, costs=TERMS,
                         outputs=("P",))


def _row(h: int) -> list:
    y = Val("y", 0, h)
    return [Def(y, Sum((Term(None, Read("U", (h,))),))), Call("Y0", (h,), y),
            Store(Var("cacc0"), Sum((Term(None, y),)), "+=")]


def test_a_fence_before_each_two_rows_around_the_knots_loop():
    head = [Def(Var("s0"), Read("S0")), Def(Var("cacc0"), Sum(()), ctype="double", const=False)]
    loop = For(4, 6, 1, tuple(_row(0)), var="kn")
    end = [Def(Var("cw0"), Read("CW0")), Call("CPART", (0,), Var("cacc0"))]
    statements = head + _row(0) + _row(1) + _row(2) + [loop] + _row(8) + _row(9) + _row(10) + end
    assert rows_fenced(statements, 2) == (head + [Fence()] + _row(0) + _row(1) + [Fence()] + _row(2) + [loop]
                                          + [Fence()] + _row(8) + _row(9) + [Fence()] + _row(10) + end)
    assert rows_fenced(statements, 0) == statements
    assert rows_fenced([s for s in statements if s is not loop], 2) == [s for s in statements if s is not loop]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_cuda_forward_fences_its_straight_line_spans_only(dtype):
    forward = _forward(_spec(dtype))
    start, end = forward.index("for (int64_t kn"), forward.index("const T cw0 = ")
    loop = forward[start:forward.index("\n        }", start)]
    assert "TS_FENCE" not in loop and "TS_FENCE" not in forward[end:]
    for stretch in (forward[:start], forward[start + len(loop):end]):
        pieces = stretch.split("TS_FENCE();")
        assert len(pieces) >= 3 and "Y0(" not in pieces[0]
        assert all(re.findall(r"Y0\((\d+)", p) and len(re.findall(r"Y0\((\d+)", p)) <= 2 for p in pieces[1:])
    assert "TS_FENCE" not in ts.source(_spec(dtype), "c")


def test_the_fenced_rows_are_data(monkeypatch):
    assert targets.CUDA_FENCED_ROWS == {4: 2, 8: 2}
    monkeypatch.setitem(targets.CUDA_FENCED_ROWS, 4, 0)
    assert "TS_FENCE" not in ts.source(_spec("float32"), "cuda") and "TS_FENCE" in _forward(_spec("float64"))
    monkeypatch.setitem(targets.CUDA_FENCED_ROWS, 8, 0)
    assert "TS_FENCE" not in ts.source(_spec("float64"), "cuda")
