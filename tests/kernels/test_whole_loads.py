"""A straight-line integrator's plain C adjoint, in its column that loads every gradient row first (the
one a share from memory runs, above ``LATE_LOADS_MAX_BYTES``), loads each output gradient's row as a
whole vector where that vector stays inside the trajectory's rows (codegen/render.py ``whole_loads``,
templates/kernel.c.j2 ``VGW``); the last rows, whose vector would reach past them, stay masked. The
lanes past a row's D dof hold the next row's values and never reach a stored lane. Other columns keep
masked loads. The gradients are the dense float64 reference's with each gradient tensor ending exactly
at an unreadable page (a load past the rows faults) and NaN before it, one and two threads; u's gradient
tensor ends at one too (its rows are stored masked: a store past them faults) and the NaN before it stays."""
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
from helpers import STRAIGHT_LINE_INTEGRATORS as WHOLE, c_functions, require_avx512, scale_close  # noqa: E402

MASKED = [
    ts.KernelSpec(horizon=32, dof=7),  # a stencil: its lane body loads the boundary rows only
    ts.KernelSpec(dof=7, control="bspline", knots=8, steps=4),  # rows loaded in loops
    ts.KernelSpec(horizon=128, dof=3, dtype="float64", control="acceleration"),  # the lane column rolled
    ts.KernelSpec(horizon=32, dof=7, control="velocity", layout="bdh"),  # no lane form
    ts.KernelSpec(horizon=9, dof=3, dtype="float64", control="velocity",  # fused
                  costs=(("squared", "position"), ("bound", "velocity")), outputs=("P",)),
]


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


if __name__ == "__main__":
    _check(int(sys.argv[1]), int(sys.argv[2]))
