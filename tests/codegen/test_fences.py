"""CUDA's fused float32 forwards with a knots' loop hold the straight-line rows after it in blocks of a
few rows (codegen/targets.py ``CUDA_FENCED_ROWS``, codegen/fences.py ``tail_fenced``): each block
``if (TS_FENCE(n)) { ... }``, the loop and the first spans as they were; float64 and C unfenced."""
from __future__ import annotations

import re

import tensorstep as ts
from tensorstep.codegen import targets
from tensorstep.codegen.fences import tail_fenced
from tensorstep.codegen.statements import Call, Def, Fenced, For, Read, Store, Sum, Term, Val, Var

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


def test_the_rows_after_the_knots_loop_are_fenced_two_by_two_and_the_rest_kept():
    loop = For(4, 6, 1, tuple(_row(0)), var="kn")
    end = [Def(Var("cw0"), Read("CW0")), Call("CPART", (0,), Var("cacc0"))]
    statements = _row(0) + [loop] + _row(8) + _row(9) + _row(10) + end
    out = tail_fenced(statements, 2)
    assert out[:4] == statements[:4] and out[-2:] == end
    assert out[4:-2] == [Fenced(0, tuple(_row(8) + _row(9))), Fenced(1, tuple(_row(10)))]
    assert tail_fenced(statements, 0) == statements
    assert tail_fenced([s for s in statements if s is not loop], 2) == [s for s in statements if s is not loop]


def test_a_block_whose_value_is_read_later_is_joined_to_the_next():
    loop = For(4, 6, 1, tuple(_row(0)), var="kn")
    later = Store(Var("cacc1"), Sum((Term(None, Val("y", 0, 8)),)), "+=")
    statements = [loop] + _row(8) + _row(10) + [later]
    out = tail_fenced(statements, 2)
    assert out == [loop, Fenced(0, tuple(_row(8) + _row(10) + [later]))]


def test_a_float32_cuda_forward_fences_its_last_spans_only():
    forward = _forward(_spec("float32"))
    loop = forward.index("for (int64_t kn")
    blocks = re.findall(r"if \(TS_FENCE\((\d+)\)\) \{(.*?)\n        \}", forward, re.S)
    assert [int(n) for n, _ in blocks] == list(range(len(blocks))) and len(blocks) >= 4
    assert forward.index("if (TS_FENCE(0))") > forward.index("\n        }", loop)  # after the loop's end
    for _, body in blocks:  # at most two rows a block, each row's stores and sums with it
        assert 1 <= body.count("Y0(") <= 2 and body.count("const T y0_") == body.count("Y0(")
    assert forward.index("const T cw0 = ") > forward.rindex("TS_FENCE(")
    assert "TS_FENCE" not in _forward(_spec("float64")) and "TS_FENCE" not in ts.source(_spec("float32"), "c")


def test_the_fenced_rows_are_data(monkeypatch):
    monkeypatch.setitem(targets.CUDA_FENCED_ROWS, 4, 0)
    assert "TS_FENCE" not in ts.source(_spec("float32"), "cuda")

