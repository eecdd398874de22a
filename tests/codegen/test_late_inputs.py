"""CUDA's fused forwards read the column inputs they use only at their end where they first use them
(codegen/targets.py ``CUDA_LATE_INPUTS``, codegen/fused.py ``inputs_where_used``): each term's per-dof
weight where the column's sum is scaled, and in float64 a goal's state after the knots' loop, each
through a volatile read; a row loop in layout bhd no larger than the costs bench's (``CUDA_INPUTS_FIRST``),
C's forwards and every adjoint keep them first."""
from __future__ import annotations

import pytest

import tensorstep as ts
from tensorstep.codegen import targets

TERMS = (("bound", "velocity"), ("squared", "position"), ("squared", "jerk"))


def _forward(spec: ts.KernelSpec, target: str = "cuda") -> str:
    source = ts.source(spec, target)
    start = source.index(f"{spec.name}_forward(")
    return source[start:source.index(f"{spec.name}_adjoint(", start)]


def _spec(dtype: str) -> ts.KernelSpec:
    return ts.KernelSpec(control="bspline", degree=3, knots=8, steps=2, end="goal", dt="per_trajectory", dof=2,
                         dtype=dtype, costs=TERMS, outputs=("P",))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_fused_cuda_forward_reads_its_weights_at_the_end_and_a_float64_goal_after_its_loop(dtype):
    forward = _forward(_spec(dtype))
    loop = forward.index("for (int64_t kn")
    for t in range(len(TERMS)):  # each weight read once, after the loop, just before its sum is scaled
        read = f"const T cw{t} = (*(volatile const T*)&(CW{t}));"
        assert forward.count(f"const T cw{t} = ") == 1 and forward.index(read) > loop
        assert forward.index(read) < forward.index(f"CPART({t},")
    goal = [f"const T e{i} = (*(volatile const T*)&(E{i}));" for i in range(3)]
    if dtype == "float64":
        assert all(forward.index(g) > loop for g in goal)
    else:  # a float32 goal's state stays first (moved, a surveyed B-spline spilled where it did not)
        assert not any(g in forward for g in goal) and forward.index("const T e0 = E0;") < loop
    assert "(*(volatile const T*)&(CW0))" not in _forward(_spec(dtype), "c")


def test_the_late_inputs_are_data(monkeypatch):
    """The rule's kinds are what the source follows: none, and the weights are read first again."""
    monkeypatch.setitem(targets.CUDA_LATE_INPUTS, 8, ())
    forward = _forward(_spec("float64"))
    assert "const T cw0 = CW0;" in forward and "const T e0 = E0;" in forward
    assert forward.index("const T cw0 = CW0;") < forward.index("for (int64_t kn")


#: the costs bench's step (bench/costs.py: seven terms, P written; rows, 7 x 1 x 4 = 28)
BENCH = dict(horizon=32, dof=7, outputs=("P",), costs=tuple(("bound", s) for s in (
    "position", "velocity", "acceleration", "jerk")) + tuple(("squared", s) for s in ("velocity", "acceleration", "jerk")))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_row_loop_in_layout_bhd_up_to_the_bench_keeps_its_inputs_first(dtype):
    """CUDA_INPUTS_FIRST: the bench's forward (rows, bhd, 28) loads its weights first, as C does;
    with a squared position added (32) or in layout bdh it reads them where it scales its sums."""
    spec = ts.KernelSpec(dtype=dtype, **BENCH)
    forward = _forward(spec)
    assert "const T cw0 = CW0;" in forward and "(*(volatile const T*)&(CW" not in forward
    assert forward.index("const T cw0 = CW0;") < forward.index("CPART(0,")
    larger = dict(BENCH, costs=BENCH["costs"] + (("squared", "position"),))
    for late in (ts.KernelSpec(dtype=dtype, **larger), ts.KernelSpec(dtype=dtype, layout="bdh", **BENCH)):
        assert "const T cw0 = (*(volatile const T*)&(CW0));" in _forward(late), late.name


def test_the_inputs_kept_first_are_data(monkeypatch):
    """Emptied, the bench's forward reads its weights late again; widened to B-splines, the B-spline of
    the first test keeps them first."""
    monkeypatch.setattr(targets, "CUDA_INPUTS_FIRST", {})
    assert "const T cw0 = (*(volatile const T*)&(CW0));" in _forward(ts.KernelSpec(**BENCH))
    monkeypatch.setattr(targets, "CUDA_INPUTS_FIRST", {("spans", "bhd"): 24})  # 3 terms x 2 rows x 4
    forward = _forward(_spec("float64"))
    assert "const T cw0 = CW0;" in forward and "const T e0 = E0;" in forward
