"""A straight-line integrator's plain C adjoint, in its column that loads every gradient row first (the
one a share from memory runs, above ``LATE_LOADS_MAX_BYTES``), loads each output gradient's row as a
whole vector where that vector stays inside the trajectory's rows (codegen/render.py ``whole_loads``,
templates/kernel.c.j2 ``VGW``); the last rows, whose vector would reach past them, stay masked. The
lanes past a row's D dof hold the next row's values and never reach a stored lane. Other columns keep
masked loads. The gradients are the dense float64 reference's with each gradient tensor ending exactly
at an unreadable page (a load past the rows faults) and NaN before it, one and two threads; u's gradient
tensor ends at one too (its rows are stored masked: a store past them faults) and the NaN before it stays.

A fused adjoint loads P's gradient rows whole in float32 (``render.FUSED_WHOLE_LOADS``) and stores u's
gradient rows whole (``render.whole_actions``, ``VGUW``): a stencil's in the order it completes them, a
recurrence's, which its reverse sweep completes last row first, held and stored in row order in blocks
(``render.HELD_ROWS``, ``whole.in_row_order``), a block's last rows masked where their lanes past the row
reach a row an earlier block stored; its paired function keeps both masked. A rolled recurrence's
(``ROLLED``) reverse loop holds each iteration's rows and stores them in row order, its top row masked. Its gradients are the dense reference's and the cost terms' definitions'
(tests/reference_costs.py) with both tensors ending at an unreadable page. With VGW's or VGUW's bound
removed (every row whole) the fused specs faulted (SIGSEGV); with the recurrences' rows stored whole as the
sweep completes them (last row first), or every held row whole (a block's last rows too), a row's vector
overwrote the next row's first dof and u's gradient differed from the reference."""
from __future__ import annotations

import ctypes
import mmap
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen import render
from tensorstep.codegen.driver import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script (below): tests/ on the path
import reference  # noqa: E402
import reference_costs  # noqa: E402
from helpers import STRAIGHT_LINE_INTEGRATORS as WHOLE, c_functions, require_avx512, scale_close  # noqa: E402

MASKED = [
    ts.KernelSpec(horizon=32, dof=7),  # a stencil: its lane body loads the boundary rows only
    ts.KernelSpec(dof=7, control="bspline", knots=8, steps=4),  # rows loaded in loops
    ts.KernelSpec(horizon=128, dof=3, dtype="float64", control="acceleration"),  # the lane column rolled
    ts.KernelSpec(horizon=32, dof=7, control="velocity", layout="bdh"),  # no lane form
    ts.KernelSpec(horizon=9, dof=3, dtype="float64", control="velocity",  # fused, float64
                  costs=(("squared", "position"), ("bound", "velocity")), outputs=("P",)),
]
_TERMS = (("bound", "position"), ("bound", "velocity"), ("bound", "acceleration"), ("bound", "jerk"),
          ("squared", "position"), ("squared", "velocity"), ("squared", "jerk"))
#: fused adjoints: float32 ones load P's gradient rows whole (render.FUSED_WHOLE_LOADS), float64 ones masked;
#: each stores u's gradient rows whole in row order (render.whole_actions; the central stencil's float32
#: paired form masked): the stencils as they complete them, the recurrences (jerk control, semi-implicit
#: Euler; velocity control, exact) held by their reverse sweep (``_action_stores``)
FUSED = [
    ts.KernelSpec(horizon=9, dof=7, dtype="float32", outputs=("P",), costs=_TERMS),
    ts.KernelSpec(horizon=12, dof=3, dtype="float32", control="jerk", outputs=("P",),
                  costs=(("squared", "position"), ("bound", "velocity"), ("bound", "acceleration"))),
    ts.KernelSpec(horizon=9, dof=7, dtype="float64", outputs=("P",), costs=_TERMS),
    ts.KernelSpec(horizon=7, dof=3, dtype="float64", control="velocity", integrator="exact", outputs=("P",),
                  costs=(("squared", "position"), ("bound", "acceleration"))),
]
#: the specs of FUSED whose reverse sweep completes u's gradient rows last row first
RECURRENCES = (1, 3)
#: recurrences above C's straight-line horizon (codegen/fused.py ``C_ROLL_RECURRENCE_ABOVE_H``): the reverse
#: sweep a loop over r, two rows an iteration (r, then r - 1), between row H - 2 and rows 1 and 0; and u's
#: gradient stores its lane columns make (``_rolled_stores``): D=5 in 8 float64 lanes reach the next row, D=3
#: in 8 float32 lanes the next two
ROLLED = [
    ts.KernelSpec(horizon=44, dof=5, dtype="float64", control="velocity", outputs=("P",),
                  costs=(("squared", "position"), ("bound", "acceleration"))),
    ts.KernelSpec(horizon=44, dof=3, dtype="float32", control="jerk", outputs=("P",),
                  costs=(("squared", "position"), ("bound", "velocity"))),
]
#: the specs of FUSED whose values are checked on one thread only (the others' two threads share one path)
ONE_THREAD = (3,)
STATES = ("position", "velocity", "acceleration", "jerk")


def _batches(spec: ts.KernelSpec) -> tuple[str, dict[str, str]]:
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    functions = c_functions(source)
    return source, {name[len(spec.name) + 1:]: text for name, text in functions.items()
                    if name.startswith(spec.name) and name.endswith("_batch")}


def _lanes(function: str) -> str:
    """A batch function's lane column (its ``#if defined(TS_LANES)`` block's last branch)."""
    return function.split("#if defined(TS_LANES)")[-1].split("#else")[0]


@pytest.mark.parametrize("spec", WHOLE, ids=lambda s: s.name)
def test_the_adjoint_loads_every_gradient_row_whole_where_inside_the_rows(spec):
    source, batches = _batches(spec)
    column = _lanes(batches["adjoint_batch"])
    loads = re.findall(r"\bVG(W?)(\d+)\((\d+)\)", column)
    assert {w for w, _, _ in loads} == {"W"}
    for k in range(spec.order + 1):
        assert sorted(int(h) for _, j, h in loads if int(j) == k) == list(range(spec.horizon)), k
        width = render.lanes(spec)["width"]
        assert (f"#define VGW{k}(h) ((h) * Y_SH + {width} <= Y_SB ? ts_vload_whole(gb{k} + (h) * Y_SH) : VG{k}(h))"
                in source)
    # the column for rows in cache (render.late_loads) keeps its masked loads
    late = _lanes(batches["adjoint_late_batch"])
    assert "VGW" not in late and re.search(r"\bVG0\(0\)", late)


@pytest.mark.parametrize("spec", MASKED, ids=lambda s: s.name)
def test_other_adjoints_keep_masked_loads(spec):
    assert "VGW" not in generate(spec, ("c",), ("core",)).source("c", "core")


@pytest.mark.parametrize("index", range(len(FUSED)), ids=[s.name for s in FUSED])
def test_a_fused_adjoint_moves_its_gradient_rows_whole_where_chosen_and_its_pairs_masked(index):
    spec = FUSED[index]
    loads_whole = spec.dtype in render.FUSED_WHOLE_LOADS
    source, batches = _batches(spec)
    adjoints = {name: text for name, text in batches.items() if name.startswith("adjoint")}
    paired = {name for name, text in adjoints.items() if "TS_PAIR_MAX_BATCH" in text}
    assert len(adjoints) > len(paired) and (paired or spec.control != "position" or spec.dtype == "float64")
    for name, text in adjoints.items():
        loads = re.findall(r"\bVG(W?)0\((\d+)\)", _lanes(text))
        assert {w for w, _ in loads} == {"W" if loads_whole else ""}, name
        assert sorted(int(h) for _, h in loads) == list(range(spec.horizon)), name
        stores = re.findall(r"\bVGU(W?)\((\d+),", _lanes(text))
        assert [(w, int(j)) for w, j in stores] == _action_stores(spec, index in RECURRENCES), name
        # a paired function's VGW0 and VGUW are its own masked loads and stores of both trajectories' rows
        assert ("#define VGW0(h) VLOADP(gb0 + (h) * Y_SH, gb0_s)" in text) == (name in paired and loads_whole), name
        assert ("#define VGUW(j, v) VSTOREP(gu + uo + (j) * U_SH, uo_s, (v))" in text) == (name in paired), name
    width = render.lanes(spec)["width"]
    assert (f"#define VGW0(h) ((h) * Y_SH + {width} <= Y_SB ? ts_vload_whole(gb0 + (h) * Y_SH) : VG0(h))"
            in source) == loads_whole
    assert (f"#define VGUW(j, v) do {{ if ((j) * U_SH + {width} <= U_SB) VSTORE_WHOLE(gu + uo + (j) * U_SH, (v)); "
            "else VGU(j, v); } while (0)" in source)


def _action_stores(spec: ts.KernelSpec, held: bool) -> list[tuple[str, int]]:
    """A fused adjoint's stores of u's gradient rows as its lane column makes them, ("W" whole or "", row): a
    stencil's in row order, all whole; a recurrence's held in blocks of ``render.HELD_ROWS`` rows, the last
    block first, each in row order, whole but a block's last rows, whose vectors' lanes past the row reach
    a row an earlier block stored."""
    N = spec.n_actions
    size = (render.HELD_ROWS[spec.dtype] or N) if held else N
    reach = -(-(render.lanes(spec)["width"] - spec.dof) // spec.dof)  # the rows a row's lanes past it fall on
    return [("" if j + reach >= min(first + size, N) < N else "W", j)
            for first in reversed(range(0, N, size)) for j in range(first, min(first + size, N))]


@pytest.mark.parametrize("integrator", ["semi_implicit_euler", "exact"])
def test_every_recurrence_holds_u_gradient_rows_and_stores_them_whole_in_row_order(integrator):
    """Each control a recurrence integrates, in both dtypes: every fused adjoint form's lane column holds u's
    gradient rows and stores them in row order (in blocks, ``_action_stores``), one after another."""
    for control, dtype in (("velocity", "float32"), ("acceleration", "float64"), ("jerk", "float32")):
        spec = ts.KernelSpec(horizon=11, dof=3, dtype=dtype, control=control, integrator=integrator, outputs=("P",),
                             costs=(("squared", "velocity"),))
        _, batches = _batches(spec)
        adjoints = [text for name, text in batches.items() if name.startswith("adjoint")]
        assert adjoints
        for text in adjoints:
            stores = re.findall(r"\bVGU(W?)\((\d+), \w+\);", _lanes(text))
            assert [(w, int(j)) for w, j in stores] == _action_stores(spec, True), spec.name
            size = render.HELD_ROWS[dtype] or spec.n_actions  # each block's rows one after another
            assert len(re.findall(r"(?:\s*VGUW?\(\d+, \w+\);)+", _lanes(text))) == -(-spec.n_actions // size)


def _guarded(n: int, dtype: torch.dtype) -> tuple[mmap.mmap, torch.Tensor, torch.Tensor]:
    """n elements ending exactly where an unreadable (and unwritable) page begins, and the NaN before
    them in their pages."""
    page = mmap.PAGESIZE
    size = -(-n * dtype.itemsize // page) * page + page
    block = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(block))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + size, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    whole = torch.frombuffer(block, dtype=dtype, count=size // dtype.itemsize)
    whole.fill_(float("nan"))
    return block, whole[whole.numel() - n:], whole[:whole.numel() - n]


def _check(index: int, threads: int) -> None:
    """The adjoint entry point on guarded gradient tensors (``_guarded``), every gradient given and all
    but the last (whose rows then come from the zero block), each call on a batch whose thread shares
    run the column that loads every row first: the gradients against the dense reference."""
    from tensorstep.runtime.launch import CpuBackend

    spec = WHOLE[index]
    dtype = torch.float32 if spec.dtype == "float32" else torch.float64
    K, H, D, N = spec.order + 1, spec.horizon, spec.dof, spec.n_actions
    share = (render.LATE_LOADS_MAX_BYTES // (((K - 1) * H * D + N * D) * dtype.itemsize) + 1)
    B = threads * share + 1
    gen = torch.Generator().manual_seed(5)
    dt = (0.05 + 0.1 * torch.rand(H, generator=gen, dtype=torch.float64) if spec.dt == "per_step"
          else torch.tensor(0.02, dtype=torch.float64)).to(dtype)
    M_u, M_s = reference.matrices(spec, dt.double().reshape(-1).tolist())
    blocks, grads, _ = zip(*(_guarded(B * H * D, dtype) for _ in range(K)))
    for g in grads:
        g.copy_(torch.randn(B * H * D, generator=gen, dtype=torch.float64))
    grads = [g.view(B, H, D) for g in grads]
    torch.set_num_threads(threads)
    backend = CpuBackend(spec)
    block_u, gu, lead = _guarded(B * N * D, dtype)  # a store past u's gradient rows faults
    gu = gu.view(B, N, D)
    for given in (K, K - 1):
        gu.fill_(float("nan"))
        gs = [torch.full((B, D), float("nan"), dtype=dtype) for _ in range(4)]
        backend.call("adjoint", B, [*(g.data_ptr() if k < given else 0 for k, g in enumerate(grads)),
                                    dt.data_ptr(), gu.data_ptr(), *(s.data_ptr() for s in gs)])
        g = np.stack([grads[k].double().numpy() if k < given else np.zeros((B, H, D)) for k in range(K)])
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        scale_close(gu.double().numpy(), np.einsum("khn,kbhd->bnd", M_u, g), tol)
        per_row = np.einsum("khm,kbhd->bmd", M_s, g)
        for m in range(4):
            scale_close(gs[m].double().numpy(), per_row[:, m], tol)
        assert torch.isnan(lead).all(), "a store before u's gradient rows"
    del blocks, block_u, lead


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("index", range(len(WHOLE)), ids=[s.name for s in WHOLE])
def test_whole_loads_read_nothing_past_the_rows_and_give_the_reference(index, threads):
    """In a child process: a load past a gradient tensor's last row faults there."""
    require_avx512()
    run = subprocess.run([sys.executable, __file__, str(index), str(threads)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])


def _cost_gradients(spec: ts.KernelSpec, Y: np.ndarray, params: dict[str, np.ndarray]) -> np.ndarray:
    """d cost[b, t] / d Y[k, b, h, d] [T, K, B, H, D], each term's derivative written from its definition
    (tests/reference_costs.py): squared 2 w (y - target), bound 2 w (max(0, y - (upper - margin)) -
    max(0, (lower + margin) - y)); checked against central differences of reference_costs.costs."""
    H = spec.horizon
    out = np.zeros((len(spec.costs), *Y.shape))
    for t, (kind, state) in enumerate(spec.costs):
        p = lambda suffix: params.get(f"{kind}_{state}_{suffix}")
        w = p("weight")[:, None, :] * (np.ones(H) if p("row_weight") is None else p("row_weight"))[None, :, None]
        y = Y[STATES.index(state)]
        if kind == "squared":
            target = params["squared_position_target"][:, None, :] if state == "position" else 0.0
            out[t, STATES.index(state)] = 2 * w * (y - target)
        else:
            (lower, upper), margin = p("limit"), p("margin")
            over, under = np.maximum(0, y - (upper - margin)), np.maximum(0, (lower + margin) - y)
            out[t, STATES.index(state)] = 2 * w * (over - under)
    differences = _cost_differences(spec, Y, params)
    scale_close(differences, out, 1e-6)
    return out


def _cost_differences(spec: ts.KernelSpec, Y: np.ndarray, params: dict[str, np.ndarray]) -> np.ndarray:
    """``_cost_gradients`` by central differences of tests/reference_costs.py's definitions, each (h, d) of
    every trajectory at once (a term is piecewise quadratic in each element: the difference is its
    derivative to rounding, away from a kink)."""
    eps = 1e-6
    out = np.zeros((len(spec.costs), *Y.shape))
    for k in range(len(STATES)):
        for h in range(spec.horizon):
            for d in range(spec.dof):
                step = np.zeros(Y.shape)
                step[k, :, h, d] = eps
                states = lambda s: {STATES[j]: (Y + s)[j] for j in range(len(STATES))}
                out[:, k, :, h, d] = ((reference_costs.costs(spec.costs, states(step), params)
                                       - reference_costs.costs(spec.costs, states(-step), params)) / (2 * eps)).T
    return out


def _check_fused(spec: ts.KernelSpec, threads: int, batches: tuple[int, ...] = ()) -> None:
    """A fused adjoint's entry point with P's gradient tensor and u's ending at an unreadable page (and NaN
    before them), P's given and not (the zero block), on a batch whose thread shares run one trajectory a
    vector (above ``PAIR_MAX_BATCH``) and on one small enough for two a vector (float32), with row weights
    and without (the forms with and without them): every gradient (u's, the start rows', the target's)
    against the dense reference and the costs' definitions, and the NaN before u's untouched."""
    from tensorstep.runtime.launch import CpuBackend

    dtype = torch.float32 if spec.dtype == "float32" else torch.float64
    tol = 1e-5 if dtype == torch.float32 else 1e-9  # float64: the central differences' rounding
    K, H, D, N = spec.order + 1, spec.horizon, spec.dof, spec.n_actions
    plain = spec.replace(costs=(), outputs=None)
    dt = 0.1
    M_u, M_s = reference.matrices(plain, [dt] * spec.n_dt if spec.dt == "per_step" else dt)
    torch.set_num_threads(threads)
    step = ts.load(spec)
    backend = CpuBackend(spec)
    gen = torch.Generator().manual_seed(11)
    r = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)
    for B in batches or (threads * (render.PAIR_MAX_BATCH + 1) + 1, 5):
        u = (0.1 * torch.randn(B, N, D, generator=gen, dtype=torch.float64)).cumsum(1)
        starts = [0.5 * torch.randn(B, D, generator=gen, dtype=torch.float64) for _ in range(4)]
        for row_weights in (True, False):
            params = {}
            for kind, state in spec.costs:
                params[f"{kind}_{state}_weight"] = 0.1 + r(B, D)
                if row_weights:
                    params[f"{kind}_{state}_row_weight"] = r(H)
                if kind == "bound":  # limits the rows cross (the bound active on some rows, not on others)
                    Y = np.einsum("hn,bnd->bhd", M_u[STATES.index(state)], u.numpy())
                    hi = torch.from_numpy(np.quantile(np.abs(Y), 0.7, axis=(0, 1))) * (0.8 + 0.4 * r(D))
                    params[f"bound_{state}_limit"] = torch.stack([-hi, hi])
                    params[f"bound_{state}_margin"] = 0.05 * hi
                if (kind, state) == ("squared", "position"):
                    params["squared_position_target"] = 0.1 * r(B, D)
            named = {"u": u, "p0": starts[0], "v0": starts[1], "a0": starts[2], "j0": starts[3], **params}
            values = [None if named.get(a.name) is None else named[a.name].to(dtype) for a in step.table.tensors]
            inputs, dt_k, _ = step._checked(values, dt)
            block, g0, _ = _guarded(B * H * D, dtype)
            g0.copy_(torch.randn(B * H * D, generator=gen, dtype=torch.float64))
            g0 = g0.view(B, H, D)
            gcost = 0.5 + torch.rand(B, len(spec.costs), generator=gen, dtype=dtype)
            Y = (np.einsum("khn,bnd->kbhd", M_u, u.to(dtype).double().numpy())
                 + np.einsum("khm,mbd->kbhd", M_s, torch.stack(starts).to(dtype).double().numpy()))
            dcost = _cost_gradients(spec, Y, {k: v.to(dtype).double().numpy() for k, v in params.items()})
            for given in (True, False):
                outs = [torch.full(s, float("nan"), dtype=dtype) for s in step.launcher.adjoint_shapes(B)]
                block_u, outs[0], lead = _guarded(B * N * D, dtype)  # a store past u's gradient rows faults
                outs[0] = outs[0].fill_(float("nan")).view(B, N, D)
                backend.call("adjoint", B, [x.data_ptr() if x is not None else 0 for x in
                                            (*inputs, g0 if given else None, gcost, dt_k, *outs)])
                gY = np.einsum("bt,tkbhd->kbhd", gcost.double().numpy(), dcost)
                if given:
                    gY[0] += g0.double().numpy()
                scale_close(outs[0].double().numpy(), np.einsum("khn,kbhd->bnd", M_u, gY), tol)
                per_start = np.einsum("khm,kbhd->mbd", M_s, gY)
                for m, o in enumerate(outs[1:5]):
                    scale_close(o.double().numpy(), per_start[m], tol)
                # the target's gradient: each squared position term depends on y - target
                t = spec.costs.index(("squared", "position"))
                expected = -np.einsum("b,bhd->bd", gcost[:, t].double().numpy(), dcost[t, 0])
                scale_close(outs[5].double().numpy(), expected, tol)
                assert torch.isnan(lead).all(), "a store before u's gradient rows"
                del block_u, lead
            del block


@pytest.mark.parametrize("index, threads", [pytest.param(i, t, id=f"{s.name}-{t}") for i, s in enumerate(FUSED)
                                            for t in (1, 2) if t == 1 or i not in ONE_THREAD])
def test_fused_whole_loads_read_nothing_past_the_rows_and_give_the_definitions(index, threads):
    """In a child process: a load past P's gradient tensor's last row, or a store past u's, faults there."""
    require_avx512()
    run = subprocess.run([sys.executable, __file__, "fused", str(index), str(threads)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])


@pytest.mark.parametrize("index", range(len(ROLLED)), ids=[s.name for s in ROLLED])
def test_a_rolled_sweep_stores_each_iteration_s_rows_in_row_order_its_top_row_masked(index):
    """A rolled recurrence's fused adjoint (``ROLLED``): each reverse loop iteration stores its rows in row
    order, r - 1 whole where its lanes past the row reach row r only (stored next), r masked (row r + 1 was
    stored by the iteration before); rows 1 and 0 after the loop in row order likewise, row H - 2 before it
    by the whole form (its test masks the last row)."""
    spec = ROLLED[index]
    _, batches = _batches(spec)
    adjoints = [text for name, text in batches.items() if name.startswith("adjoint")]
    assert adjoints
    for text in adjoints:
        column = _lanes(text)
        sweep = column.index(f"for (int64_t r = {spec.horizon - 3}; r >= 3; r -= 2) {{")
        assert re.findall(r"\bVGU(W?)\(([^,]+),", column[:sweep]) == [("W", str(spec.n_actions - 1))]
        assert re.findall(r"\bVGU(W?)\(([^,]+),", column[sweep:]) == _rolled_stores(spec)


def _rolled_stores(spec: ts.KernelSpec) -> list[tuple[str, str]]:
    """u's gradient stores a ``ROLLED`` spec's lane column makes from its reverse loop on: "W" where the row's
    vector reaches the next row only."""
    w = "W" if render.lanes(spec)["width"] - spec.dof <= spec.dof else ""
    return [(w, "r - 1"), ("", "r"), (w, "0"), ("", "1")]


@pytest.mark.parametrize("index", [0])
def test_a_rolled_sweep_s_whole_rows_give_the_definitions_and_store_nothing_past_the_rows(index):
    """In a child process: ``_check_fused`` of a ``ROLLED`` spec, one thread, B=7 (with the whole stores'
    rule undone, every row whole, an iteration's top row overwrites the next row's first dof)."""
    require_avx512()
    run = subprocess.run([sys.executable, __file__, "rolled", str(index)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])


if __name__ == "__main__":
    if sys.argv[1] == "fused":
        _check_fused(FUSED[int(sys.argv[2])], int(sys.argv[3]))
    elif sys.argv[1] == "rolled":
        _check_fused(ROLLED[int(sys.argv[2])], 1, (7,))
    else:
        _check(int(sys.argv[1]), int(sys.argv[2]))
