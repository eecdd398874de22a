"""A straight-line integrator's C forward stores each output row as a whole vector where that vector
stays inside the trajectory's rows (codegen/render.py ``whole_rows``, templates/kernel.c.j2 ``VYW``):
the lanes past a row's D dof land on the output's next rows, which the column stores after it, and
the last rows, whose vector would reach past the trajectory, stay masked. Other forms keep their
masked stores. The values are the dense float64 reference's, and nothing outside the outputs' rows
is written, for vectors of one row and a bit (D=7) and of more than two rows (D=3, float32)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import reference
import tensorstep as ts
from tensorstep.codegen import printer, render, whole
from tensorstep.codegen.driver import generate
from tensorstep.codegen.statements import Call, Def, For, Read, Rel, Store, Val, Var, walk
from tensorstep.runtime.launch import CpuBackend
from helpers import STRAIGHT_LINE_INTEGRATORS as WHOLE, c_functions, require_avx512, scale_close

MASKED = [
    ts.KernelSpec(horizon=32, dof=7),  # a stencil: its loops write the interior rows
    ts.KernelSpec(dof=7, control="bspline", knots=8, steps=4),  # rows in loops
    ts.KernelSpec(horizon=128, dof=3, dtype="float64", control="acceleration"),  # the lane column rolled
    ts.KernelSpec(horizon=32, dof=7, control="velocity", layout="bdh"),  # no lane form
]


def _forward(spec: ts.KernelSpec) -> str:
    functions = c_functions(generate(spec, ("c",), ("core",)).source("c", "core"))
    return functions[f"{spec.name}_forward"]


def _lanes(forward: str) -> str:
    """The lane form's column of a forward (its ``#if defined(TS_LANES)`` branch)."""
    return forward.split("#if defined(TS_LANES)")[1].split("#else")[0]


@pytest.mark.parametrize("spec", WHOLE, ids=lambda s: s.name)
def test_a_straight_line_forward_stores_rows_whole_and_asks_for_none_to_be_written(spec):
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    forward = _forward(spec)
    column = _lanes(forward)
    stores = re.findall(r"\bVY(W?)(\d+)\((\d+),", column)
    assert {w for w, _, _ in stores} == {"W"}
    for k in range(spec.order + 1):
        assert [int(h) for _, j, h in stores if int(j) == k] == list(range(spec.horizon)), k
        width = render.lanes(spec)["width"]
        assert (f"#define VYW{k}(h, v) do {{ if ((h) * Y_SH + {width} <= Y_SB) VSTORE_WHOLE(y{k} + yo + (h) * Y_SH, (v)); "
                f"else VY{k}(h, v); }} while (0)") in source
    assert "TS_PREFETCH_ROW_WRITE" not in forward and "TS_PREFETCH_ROW(u + (ahead) * U_SB, U_SB);" in forward
    assert "Y_SB + Y_SB" in forward  # the gate still counts the outputs' rows: the share's bytes in cache


@pytest.mark.parametrize("spec", MASKED, ids=lambda s: s.name)
def test_other_columns_keep_masked_stores(spec):
    assert "VYW" not in generate(spec, ("c",), ("core",)).source("c", "core")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", WHOLE, ids=lambda s: s.name)
def test_whole_rows_give_the_reference_values_and_write_nothing_else(spec, threads):
    """The entry point on outputs inside a larger buffer of NaN, one trajectory's rows of it before
    and after each: those stay NaN bit for bit, and the outputs are the dense float64 reference's."""
    require_avx512()
    B, H, D, N = 9, spec.horizon, spec.dof, spec.n_actions
    dtype = torch.float32 if spec.dtype == "float32" else torch.float64
    gen = torch.Generator().manual_seed(3)
    S = B + 4 if spec.start_index else B
    u = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    starts = [torch.randn(S, D, generator=gen, dtype=torch.float64) for _ in range(4)]
    idx = torch.randint(0, S, (B,), generator=gen) if spec.start_index else None
    dt = (0.05 + 0.1 * torch.rand(H, generator=gen, dtype=torch.float64) if spec.dt == "per_step"
          else torch.tensor(0.02, dtype=torch.float64))
    K = spec.order + 1
    buffers = [torch.full((B + 2, H, D), float("nan"), dtype=dtype) for _ in range(K)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        backend = CpuBackend(spec)
        args = [u.to(dtype), *(x.to(dtype) for x in starts), dt.to(dtype)]
        call = [*(a.data_ptr() for a in args[:5]), idx.data_ptr() if idx is not None else 0, args[5].data_ptr(),
                *(y[1:B + 1].data_ptr() for y in buffers)]
        backend.call("forward", B, call)
    finally:
        torch.set_num_threads(before)
    M_u, M_s = reference.matrices(spec, dt.reshape(-1).tolist())
    s = torch.stack(starts, 1)[idx if idx is not None else slice(None)].to(dtype).double().numpy()
    expected = (np.einsum("khn,bnd->kbhd", M_u, u.to(dtype).double().numpy())
                + np.einsum("khm,bmd->kbhd", M_s, s))
    for k, y in enumerate(buffers):
        assert torch.isnan(y[0]).all() and torch.isnan(y[B + 1]).all(), k
        scale_close(y[1:B + 1].double().numpy(), expected[k], 1e-5 if dtype == torch.float32 else 1e-12)


def test_the_pass_marks_stores_in_order_and_literal_loads_and_the_lane_printer_prints_them_whole():
    """codegen/whole.py decides from the statements and marks them (``Call.whole``, ``Read.whole``); the
    lane printer prints a marked store or load by its macro's whole form, the scalar column none."""
    output = lambda macro: macro == "Y0"
    y = [Call("Y0", (h,), Val("y", 0, h)) for h in range(3)]
    assert whole.stored_in_order(y, output, 3)
    assert not whole.stored_in_order(y[::-1], output, 3)  # last row first: a row's lanes past it lost
    assert not whole.stored_in_order(y[:2], output, 3)  # a row never stored
    assert not whole.stored_in_order([y[0], For(1, 2, 1, (Call("Y0", (Rel(0),), Val("y", 0, 1)),))], output, 3)
    assert not whole.stored_in_order([Call("Y1", (0,), Val("y", 1, 0))], output, 1)  # no store of Y0
    g = [Def(Val("g", 0, h), Read("G0", (h,))) for h in range(2)]
    assert whole.loaded_literal(g, lambda macro: macro == "G0")
    assert not whole.loaded_literal([*g, Def(Var("x"), Read("G0", (Rel(0),)))], lambda macro: macro == "G0")
    lanes = printer.lane_printer(frozenset({"U", "GU"}))  # the lane macros of the actions and their gradient
    body = whole.marked([*y, *g, Call("GU", (0,), Read("U", (0,)))], output, lambda macro: macro == "G0")
    assert lanes.lines(body) == ["VYW0(0, y0_0);", "VYW0(1, y0_1);", "VYW0(2, y0_2);", "const VT g0_0 = VGW0(0);",
                                 "const VT g0_1 = VGW0(1);", "VGU(0, VU(0));"]
    assert lanes.lines(whole.marked(y[:1], lambda macro: macro == "Y0")) == ["VYW0(0, y0_0);"]
    with pytest.raises(AssertionError):
        printer.COLUMN.lines(body)


def test_stores_made_last_row_first_are_held_to_the_last_and_made_in_row_order():
    """``whole.in_row_order``: a reverse sweep's stores (row 2, 1, 0) move to where row 0's was, in row
    order, and then pass ``stored_in_order``; stores it cannot move stay where they are."""
    gu = lambda macro: macro == "GU"
    sweep = [Def(Val("yb", 0, 3), Read("G0", (3,))), Call("GU", (2,), Val("yb", 0, 3)),
             Def(Val("yb", 0, 2), Read("G0", (2,))), Call("GU", (1,), Val("yb", 0, 2)),
             Def(Val("yb", 0, 1), Read("G0", (1,))), Call("GU", (0,), Val("yb", 0, 1)),
             Call("GS0", (), Val("yb", 0, 1))]
    held = whole.in_row_order(sweep, gu)
    assert held == (sweep[0], sweep[2], sweep[4], sweep[5], sweep[3], sweep[1], sweep[6])
    assert whole.stored_in_order(held, gu, 3) and not whole.stored_in_order(sweep, gu, 3)
    assert whole.in_row_order(held, gu) == held
    kept = [
        [*sweep, Call("GU", (1,), Val("yb", 0, 1))],  # a row stored twice
        [For(3, 4, 1, (For(0, 1, 1, (Call("GU", (Rel(0),), Val("yb", 0, 1)),)), Call("GU", (Rel(-1),), Val("yb", 0, 1))))],
        [Call("GU", (Rel(0),), Val("yb", 0, 1)), *sweep[2:]],  # a row not literal
        [Def(Var("x"), Read("G0", (0,)), const=False), Call("GU", (1,), Var("x")),  # its value assigned later
         Store(Var("x"), Read("G0", (1,)), "+="), Call("GU", (0,), Var("x"))],
        [Call("GU", (1,), Read("X", (0,))), Store(Read("X", (0,)), Val("yb", 0, 1)),  # its value stored through
         Call("GU", (0,), Val("yb", 0, 1))],
    ]
    for statements in kept:  # (the loop's: a store in a nested loop)
        assert whole.in_row_order(statements, gu) == tuple(statements)
    # in blocks of 2 rows, each where its last store was; a row whole where the rows its lanes past reach
    # are stored after it (row 1's next row, 2, is stored before it; row 3's is past the rows)
    sweep = [Call("GU", (h,), Val("yb", 0, h + 1)) for h in reversed(range(4))]
    blocks = whole.in_row_order(sweep, gu, 2)
    assert blocks == (sweep[1], sweep[0], sweep[3], sweep[2]) and whole.stored_once(blocks, gu, 4)
    lanes = printer.lane_printer(frozenset({"U", "GU"}))
    assert lanes.lines(whole.marked(blocks, gu)) == ["VGUW(2, yb0_3);", "VGUW(3, yb0_4);", "VGUW(0, yb0_1);",
                                                     "VGU(1, yb0_2);"]
    assert lanes.lines(whole.marked(blocks, gu, reach=2))[2:] == ["VGU(0, yb0_1);", "VGU(1, yb0_2);"]
    assert [c.whole for c in whole.marked(sweep, gu)] == [True, False, False, False]  # last row first: the last only
    # a forward's outputs, each in row order, interleaved: as they are
    outputs = [Call(f"Y{k}", (h,), Val("y", k, h)) for h in range(2) for k in range(2)]
    assert whole.in_row_order(outputs, lambda macro: macro in ("Y0", "Y1")) == tuple(outputs)


def test_a_rolled_sweep_holds_each_iteration_s_rows_and_the_rows_between_loops_and_masks_each_top_row():
    """A rolled reverse sweep: row 6, a loop over r = 5, 3 (rows r and r - 1 each iteration, r first), rows 1
    and 0. Each iteration's stores are made in row order at the place of its last, and so are the rows after
    the loop; a row is whole where the rows its lanes past reach are stored after it in every iteration
    (``whole._made``): r - 1 (r follows), not r (r + 1 was stored by the iteration before), 0 and not 1 (row
    2 was stored in the loop), 6 (past the last row: the whole form's test masks it)."""
    gu = lambda macro: macro == "GU"
    loop = For(5, 3, -2, (Def(Val("yb", 0, Rel(0)), Read("G0", (Rel(0),))), Call("GU", (Rel(0),), Val("yb", 0, Rel(0))),
                          Def(Val("yb", 0, Rel(-1)), Read("G0", (Rel(-1),))),
                          Call("GU", (Rel(-1),), Val("yb", 0, Rel(-1))), Store(Var("c"), Val("yb", 0, Rel(-1)))),
               unroll=False)
    sweep = [Call("GU", (6,), Val("yb", 0, 7)), loop, Call("GU", (1,), Val("yb", 0, 2)), Def(Var("x"), Read("G0", (0,))),
             Call("GU", (0,), Var("x")), Call("GS0", (), Var("x"))]
    held = whole.in_row_order(sweep, gu, 8)
    body = (loop.body[0], loop.body[2], loop.body[3], loop.body[1], loop.body[4])
    assert held == (sweep[0], dataclasses.replace(loop, body=body), sweep[3], sweep[4], sweep[2], sweep[5])
    assert whole.in_row_order(held, gu, 8) == held
    assert whole.stored_once(held, gu, 7) and whole.stored_once(sweep, gu, 7) and not whole.stored_once(sweep, gu, 8)
    stores = lambda statements: [(c.args[0] if c.args else (), c.whole) for c in walk(statements) if isinstance(c, Call)]
    assert stores(whole.marked(held, gu)) == [(6, True), (Rel(-1), True), (Rel(0), False), (0, True), (1, False),
                                             ((), False)]
    assert stores(whole.marked(sweep, gu)) == [(6, True), (Rel(0), False), (Rel(-1), False), (1, False), (0, False),
                                              ((), False)]
    # lanes past the row reaching two rows: r - 1's reach r + 1, stored before; 0's reach 2
    assert [w for _, w in stores(whole.marked(held, gu, reach=2))] == [True] + [False] * 5
    lanes = printer.lane_printer(frozenset({"U", "GU"}))
    text = "\n".join(lanes.lines(whole.marked(held, gu)))
    assert re.search(r"for \(int64_t r = 5; r >= 3; r -= 2\) \{\n.*\n.*\n *VGUW\(r - 1, .*\n *VGU\(r, ", text), text
    # a loop over rows that are not literal (a knot loop's), or one its threads share: nothing whole
    for other in (dataclasses.replace(loop, first=Var("k0")), dataclasses.replace(loop, shared=True)):
        statements = [sweep[0], other, *sweep[2:]]
        assert not whole.stored_once(statements, gu, 7)
        assert [w for _, w in stores(whole.marked(whole.in_row_order(statements, gu), gu))] == [False] * 6
