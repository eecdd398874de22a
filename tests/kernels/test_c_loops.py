"""The C kernels' interior loops over the batch: an action's gradient is gathered from every
output gradient in one pass (absent ones read the zero block), and each thread holds its own
copy of a short coefficient table. Exact against the dense reference with every subset of the
outputs in the loss, at batches that the kernels split over threads."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen import render
from tensorstep.codegen.driver import generate

import reference
from helpers import Inputs, assembly, c_functions, compiler_output, dt_value, require_avx512, scale_close

#: long enough for interior loops; uniform dt, a wide stencil, and per-step durations (the
#: loops' coefficients advance with the row)
SPECS = [
    ts.KernelSpec(horizon=32, dof=3, dtype="float64", difference="backward", accuracy=1),
    ts.KernelSpec(horizon=24, dof=3, dtype="float64", difference="central", accuracy=6, end="one_sided", order=4),
    ts.KernelSpec(horizon=24, dof=3, dtype="float64", difference="central", accuracy=2, dt="per_step"),
]
BATCH = 70  # at least 64: the C kernels split the batch over OpenMP threads


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_each_actions_gradient_is_gathered_in_one_pass(spec):
    """Before: a pass zeroing the actions' gradients, then one pass adding each output's share."""
    functions = c_functions(generate(spec, ("c",), ("core",)).source("c", "core"))
    adjoint = functions[f"{spec.name}_adjoint"]
    assert "SGU +=" not in adjoint
    passes = adjoint.count("SGU =")
    assert passes >= 1
    for k in range(spec.order + 1):  # every output's gradient is read in those passes
        assert f"SG{k}(" in adjoint


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_subset_of_output_gradients_is_the_exact_adjoint(spec, autograd_path):
    step = autograd_path(ts.load(spec))
    x = Inputs(spec, batch=BATCH, requires_grad=True)
    dt = dt_value(spec)
    outs = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(len(outs), *outs[0].shape, generator=gen, dtype=torch.float64)
    M_u, _ = reference.matrices(spec, dt.tolist() if dt.ndim else [float(dt)])
    for used in itertools.chain.from_iterable(itertools.combinations(range(len(outs)), n) for n in (1, 2, 3)):
        (gu,) = torch.autograd.grad([outs[k] for k in used], [x.u], [g[k] for k in used], retain_graph=True)
        expect_u = np.einsum("khn,kbhd->bnd", M_u[list(used)], g[list(used)].numpy())
        scale_close(gu.numpy(), expect_u, 1e-12)


def _coefficient_tables(source: str) -> dict[str, str]:
    """How each batch function holds the step coefficients: 'copy' (its own array, filled from
    the entry point's), 'shared' (the entry point's array), 'own' (made per trajectory)."""
    tables = {}
    for name, text in c_functions(source).items():
        if not name.endswith("_batch"):
            continue
        kernel = name[: -len("_batch")].rsplit("_o3_", 1)[1]
        copies = re.findall(r"(\w+)\[i\] = \1_in\[i\];", text)
        shared = re.findall(r"const T\* restrict (\w+) = \1_in;", text)
        tables[kernel] = ("copy", *copies) if copies else ("shared", *shared) if shared else ("own",)
    return tables


def test_threads_copy_short_coefficient_tables(monkeypatch):
    """forward, adjoint, dt_vjp (coef) and dt_jvp (coef, coefd) run their batch loops on a copy
    of the table of their own (each thread calls the batch function); one table per trajectory
    is made inside the loop, and a long table is read where it is."""
    spec = SPECS[0]
    source = generate(spec, ("c",), ("all",)).source("c", "all")
    assert _coefficient_tables(source) == {"forward": ("copy", "coef"), "adjoint": ("copy", "coef"),
                                           "dt_vjp": ("copy", "coef"), "dt_jvp": ("copy", "coef", "coefd")}
    per_trajectory = ts.KernelSpec(horizon=32, dof=3, dtype="float64", difference="backward", dt="per_trajectory")
    assert set(_coefficient_tables(generate(per_trajectory, ("c",), ("core",)).source("c", "core")).values()) == {
        ("own",)}
    monkeypatch.setattr(render, "C_PRIVATE_COEFFICIENTS", 4)
    assert set(_coefficient_tables(generate(spec, ("c",), ("core",)).source("c", "core")).values()) == {
        ("shared", "coef")}


def _serial_and_parallel_branches(expanded: str, entry_point: str) -> tuple[str, str]:
    entry = re.search(rf"void {entry_point}\(.*?\n\}}", expanded, re.S).group(0)
    serial, parallel = entry.split("else", 1)
    return serial, parallel


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1].replace(dt="per_trajectory")], ids=lambda s: s.name)
def test_a_small_batch_runs_outside_an_openmp_region(spec, tmp_path):
    """Below TS_MIN_PARALLEL_BATCH the entry point calls its batch function directly: an OpenMP
    region, even with one thread, sets up a team and ends with a futex call on every kernel call
    (B=1 timings: docs/benchmarks-history.md, eighteenth session). Each entry point calls its batch
    function once in the serial branch and once inside the region."""
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    functions = c_functions(source)
    for kernel in ("forward", "adjoint"):
        entry = functions[f"{spec.name}_{kernel}"]
        assert re.search(rf"TS_BATCH\({spec.name}_{kernel}_batch, B, ", entry), entry
        assert f"{spec.name}_{kernel}_batch" in functions
    assert "#define TS_MIN_PARALLEL_BATCH 64" in source
    serial, parallel = _serial_and_parallel_branches(compiler_output(spec, tmp_path, "-E", "-P"), f"{spec.name}_forward")
    assert "if ((B) < (64))" in serial and f"{spec.name}_forward_batch(0, (B)," in serial
    assert "omp parallel" in parallel and "pragma" in parallel


def test_a_single_chunk_of_dt_gradients_runs_outside_an_openmp_region(tmp_path):
    """The uniform-dt gradient sums its batch in chunks of TS_DT_CHUNK (64); one chunk is summed
    by the calling thread. It was an `omp parallel for if(n_chunks > 1)`, which still sets up a
    team of one and ends it with a futex wake on every call."""
    spec = SPECS[0]
    expanded = compiler_output(spec, tmp_path, "-E", "-P", part="dt")
    serial, parallel = _serial_and_parallel_branches(expanded, f"{spec.name}_dt_vjp")
    assert "if ((n_chunks) < (2))" in serial and f"{spec.name}_dt_vjp_batch(0, (n_chunks)," in serial
    assert "omp parallel" in parallel and f"{spec.name}_dt_vjp_batch(" in parallel


@pytest.mark.parametrize("spec", [
    ts.KernelSpec(horizon=32, dof=7, control="acceleration", integrator="semi_implicit_euler"),
    ts.KernelSpec(horizon=24, dof=7, control="jerk", integrator="semi_implicit_euler", order=4),
    ts.KernelSpec(horizon=32, dof=7, control="acceleration", integrator="exact"),
], ids=lambda s: s.name)
def test_a_recurrences_carried_value_is_added_last(spec):
    """A column sum is evaluated left to right, so the previous row's adjoint, the value the
    recurrence carries, comes last (lower._shallow_first): its chain is then one add per row, not an add and an FMA
    (semi-implicit Euler's adjoint took 21-22 us against 16.5-17 us at B=400:
    docs/benchmarks-history.md, seventeenth session, item 8).
    Its exactness is checked by the numerics and lane tests against the dense reference."""
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    (adjoint,) = [text for name, text in c_functions(source).items() if name.endswith("_adjoint")]
    carried = 0
    for k, h, value in re.findall(r"const VT yb(\d)_(\d+) = ([^;]+);", adjoint):
        previous = f"yb{k}_{int(h) + 1}"
        terms = re.split(r"(?=[+-])", value)
        # (the last rows, where the chains start, may order by their own readiness)
        if int(h) < spec.horizon - 3 and any(t.lstrip("+-") == previous for t in terms):
            carried += 1
            assert terms[-1].lstrip("+") == previous, (k, h, value)
    assert carried >= spec.horizon - 4


def test_the_vectorised_loops_use_256_bit_vectors_on_x86(tmp_path):
    """Position control's interior rows are loops gcc vectorises. Tuning an AVX-512 AMD core as an
    older one, gcc 12 made them 512-bit, which took longer per call than 256-bit
    (docs/benchmarks-history.md,
    eighteenth session); gcc's own tuning for Intel's AVX-512 cores prefers 256 bits as well.
    7 float32 dof are one 256-bit lane vector, so nothing is 512-bit."""
    require_avx512()
    text = assembly(ts.KernelSpec(horizon=32, dof=7, difference="backward"), tmp_path)
    assert "%ymm" in text
    assert "%zmm" not in text


def _top_level_terms(expr: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in expr:
        depth += (ch == "(") - (ch == ")")
        if ch in "+-" and depth == 0 and current:
            parts.append(current)
            current = ""
        current += ch
    return parts + [current]


def test_a_long_gradient_sum_is_several_chains():
    """A B-spline knot's gradient sums 20-30 rows' terms, all loaded up front; as one sum evaluated
    left to right it was one chain of dependent FMAs, latency-bound (the adjoint took 248 ns per
    trajectory in cache, 218-224 ns as two to four partial sums:
    docs/benchmarks-history.md, twenty-first session). The
    exactness of the reordered sums is checked by the B-spline tests against SciPy."""
    spec = ts.KernelSpec(dof=7, control="bspline", degree=4, knots=8, steps=4, dtype="float32")
    source = generate(spec, ("c",), ("core",)).source("c", "core")
    (adjoint,) = [text for name, text in c_functions(source).items() if name.endswith("_adjoint_batch")]
    lane_body = adjoint[:adjoint.index("#else")]
    long_sums = 0
    for expr in re.findall(r"VGU\(\d+, (.+)\);", lane_body):
        parts = [p.lstrip("+") for p in _top_level_terms(expr)]
        # terms per part: a parenthesised partial sum's, or 1 for a plain term
        lengths = [len(_top_level_terms(p[1:-1])) if p.startswith("(") else 1 for p in parts]
        terms = sum(lengths)
        if terms < 16:
            continue
        long_sums += 1
        assert max(lengths) + len(parts) - 1 <= -(-terms // 2) + 2, (terms, lengths)
    assert long_sums >= 4
