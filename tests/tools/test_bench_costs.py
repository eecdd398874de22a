"""`tensorstep bench --scheme costs` (bench/costs.py): it runs end to end on a tiny case, its PyTorch
costs are the definitions, and what it prints is consistent (agreement, ratios, the breakdown).
Speed is not asserted: a tiny budget checks the command, not the timings."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import reference
import reference_costs
import tensorstep as ts
from tensorstep.bench import costs, costs_outputs, costs_threads
from tensorstep.cli import main

UNITS = {"µs": 1e-6, "ms": 1e-3}


def seconds(cell: str) -> float:
    value, unit = cell.replace("−", "-").split()
    return float(value) * UNITS[unit]


def rounding(cell: str) -> float:
    """Half a unit of the printed cell's last digit, in seconds (the time it stands for is within it)."""
    value, unit = cell.split()
    return 0.5 * 10.0 ** -len(value.split(".")[1]) * UNITS[unit]


def table_rows(output: str, header_start: str) -> list[list[str]]:
    """The cells of each data row of the table whose header line starts with ``header_start``."""
    lines = output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def printed() -> str:
    result = CliRunner().invoke(main, ["bench", "--scheme", "costs", "--batch", "3", "--horizon", "8",
                                       "--dtype", "float64", "--budget", "0.01", "--no-codegen"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.output


def test_fused_and_compiled_agree_with_the_unfused_step_plus_costs(printed):
    found = re.findall(r"B=3 float64 (fused|fused_held|compiled) against unfused \+ eager costs, largest relative "
                       r"difference: P (\S+), cost (\S+), grad u (\S+)", printed)
    assert sorted(name for name, *_ in found) == ["compiled", "fused", "fused_held"]
    for _, *errors in found:
        assert max(float(e) for e in errors) < 1e-12


def test_the_table_and_its_ratios(printed):
    (row,) = table_rows(printed, "| H | B | dtype | (a) fused")
    assert row[:3] == ["8", "3", "float64"] and len(row) == 16
    times = dict(zip("aAbcdef", row[3:10]))  # A: (a'), the fused step holding its cost parameters
    ratios = [float(cell.rstrip("×")) for cell in row[10:]]
    assert len(ratios) == 6
    # each ratio from the unrounded times: within what the printed times' rounding allows
    for ratio, (num, den) in zip(ratios, ["ba", "ca", "ad", "Ad", "ae", "af"]):
        n, dn = seconds(times[num]), rounding(times[num])
        d, dd = seconds(times[den]), rounding(times[den])
        assert (n - dn) / (d + dd) - 0.005 <= ratio <= (n + dn) / (d - dd) + 0.005, (ratio, times[num], times[den])


def test_the_breakdown_adds_up(printed):
    (row,) = table_rows(printed, "| H | B | dtype | fused call (a)")
    assert row[:3] == ["8", "3", "float64"] and len(row) == 11
    total, table, params, forward, adjoint, _no_grad, rest, _plain = (seconds(cell) for cell in row[3:])
    assert rest == pytest.approx(total - forward - adjoint, abs=sum(map(rounding, row[3:10])))
    (main_row,) = table_rows(printed, "| H | B | dtype | (a) fused")
    assert row[3] == main_row[3]  # the same timing of the fused call


def test_eager_costs_are_the_definitions():
    """bench/costs.py's PyTorch terms against tests/reference_costs.py (NumPy float64), on states
    from tests/reference.py, with limits crossed on some rows."""
    case = costs.CostCase(batch=4, dtype="float64", horizon=8)
    gen, u, starts = costs._inputs(case)
    params = costs.parameters(case, gen)
    spec = case.plain
    K = spec.order + 1
    Y = np.zeros((K, case.batch, case.horizon, case.dof))
    start = torch.stack([*starts, torch.zeros_like(starts[0])], 1).numpy()
    for b in range(case.batch):
        for d in range(case.dof):
            Y[:, b, :, d] = reference.column(spec, u.numpy()[b, :, d], start[b, :, d], costs.DT)
    expected = reference_costs.costs(costs.TERMS, dict(zip(costs.STATES, Y)),
                                     {k: v.numpy() for k, v in params.items()})
    got = costs.eager_costs(tuple(torch.from_numpy(y) for y in Y), params).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-13)
    crossed = [float((np.abs(Y[k]) > params[f"bound_{s}_limit"][1].numpy()).mean()) for k, s in enumerate(costs.STATES)]
    assert all(0 < c < 1 for c in crossed[1:]), crossed  # bounds crossed on some rows, not on all


def test_the_copy_bound_counts_what_the_fused_op_moves():
    case = costs.CostCase(batch=5, dtype="float64", horizon=8)
    step = ts.load(case.fused)
    gen, u, starts = costs._inputs(case)
    P, cost = step(u, *starts, costs.DT, **costs.parameters(case, gen))
    assert costs.copy_elements(case) == u.numel() + P.numel() + cost.numel()


def test_the_kernels_write_the_same_into_every_allocation():
    """bench/costs_outputs.py: its forward writes the step's P and cost and its adjoint the step's
    gradient of u (autograd through the step), into new, advised and kept outputs alike."""
    case = costs.CostCase(batch=5, dtype="float64", horizon=8)
    gen, u, starts = costs._inputs(case)
    params = costs.parameters(case, gen)
    W = torch.randn(case.batch, case.horizon, case.dof, dtype=torch.float64)
    u.requires_grad_(True)
    P, cost = ts.load(case.fused)(u, *starts, costs.DT, **params)
    (grad,) = torch.autograd.grad((P * W).sum() + cost.sum(), u)
    methods = costs_outputs.callables(case, W)
    copies = {}
    for allocation in costs_outputs.allocations(case):
        P_, cost_ = methods[f"forward kernel, {allocation}"]()
        (grad_,) = methods[f"adjoint kernel, {allocation}"]()
        assert torch.equal(P_, P.detach()) and torch.equal(cost_, cost.detach()) and torch.equal(grad_, grad)
        for k, n in (("forward", P.numel() + cost.numel()), ("adjoint", u.numel())):
            (copied,) = methods[f"copy of the {k}'s outputs, {allocation}"]()
            assert copied.numel() == n and copied.abs().min() > 0  # every element written (from random values)
            assert torch.equal(copies.setdefault(k, copied), copied)


def test_the_breakdowns_kernel_inputs_are_what_the_python_path_launches(monkeypatch):
    """The breakdown's checks and kernels take their inputs from the fused step's own checks
    (Step ``_checked``): the tensors are the ones a call on the Python path hands its forward
    kernel (the kept ones, once kept), and the same values on a fresh step."""
    case = costs.CostCase(batch=5, dtype="float64", horizon=8)
    gen, u, starts = costs._inputs(case)
    params = {**costs.parameters(case, gen), "squared_velocity_weight": torch.rand(5, case.dof, generator=gen,
                                                                                   dtype=torch.float64)}
    step = ts.load(case.fused)
    step.native = None
    launched = []
    forward = step.launcher.forward
    monkeypatch.setattr(step.launcher, "forward",
                        lambda inputs, dt, **k: launched.append(inputs) or forward(inputs, dt, **k))
    with torch.no_grad():
        step(u, *starts, costs.DT, **params)
    values = costs.table_values(step.table, u, starts, params)
    got = costs.kernel_inputs(step, values)
    assert len(got) == len(launched[0]) == len(step.table.tensors)
    assert all(x is y for x, y in zip(got, launched[0]))
    fresh = costs.kernel_inputs(ts.load(case.fused), values)
    for arg, x, y in zip(step.table.tensors, got, fresh):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), arg.name


def test_the_thread_table(capsys):
    """bench/costs_threads.py: one and two threads, each method timed once per thread count; the
    fused call the same bits with both; each round's (a)/(f) from the printed times; the caller's
    thread count restored."""
    before = torch.get_num_threads()
    # B=200: above TS_MIN_PARALLEL_BATCH, so that two threads split the batch in the bit-for-bit check
    assert costs_threads.main(["200", "--rounds", "1", "--budget", "0.001"]) == 0
    assert torch.get_num_threads() == before
    printed = capsys.readouterr().out
    assert "the same bits with 1, 2 threads: yes" in printed
    rows = table_rows(printed, "| threads | method")
    labels = list(costs_threads.METHODS.values())
    assert [row[:2] for row in rows] == [[n, m] for n in "12" for m in [*labels, "(a) / (f), round by round"]]
    for n in "12":
        cells = {row[1]: row[2].split(" (")[0] for row in rows if row[0] == n}  # one round: median = the sample
        a, f = cells["(a) fused"], cells["(f) copy bound, outputs as (a)'s"]
        ratio = float(cells["(a) / (f), round by round"].rstrip("×"))
        lo = (seconds(a) - rounding(a)) / (seconds(f) + rounding(f))
        hi = (seconds(a) + rounding(a)) / (seconds(f) - rounding(f))
        assert lo - 0.005 <= ratio <= hi + 0.005, (ratio, a, f)
    assert re.search(r"\(a\) fused: 1 thread\(s\) / 2 threads, round by round: \S+×", printed)


def test_the_copy_bounds_read_written_memory(monkeypatch):
    """Each bench's copy bound copies a source whose every element is written and nonzero: an
    unwritten torch.empty (or a calloc'd torch.zeros) of a large size reads the system's zero page,
    which moves no memory, and made the bound too low."""
    from tensorstep.bench import baselines, bspline, harness

    src = baselines.copy_source(3 << 20, torch.float32, torch.device("cpu"))  # 12 MiB: mmap'd pages
    assert src.shape == (3 << 20,) and int(torch.count_nonzero(src)) == src.numel()
    seen = []
    real = baselines.copy_source
    for module in (costs, harness, bspline):
        monkeypatch.setattr(module, "copy_source", lambda *a, **k: seen.append(a) or real(*a, **k))
    costs.case_callables(costs.CostCase(batch=3), inductor=False)
    harness.case_callables(harness.Case(scheme="central", horizon=8, batch=3, dtype="float64"), inductor=False)
    bspline.case_callables(bspline.BSplineCase(batch=3), inductor=False)
    assert len(seen) == 3


def test_the_cuda_host_bench_runs_with_launches_stubbed(capsys):
    """`python -m tensorstep.bench.cuda_host --stub` (the GPU script's CPU mode): it times the three
    launch paths (the native node's, and the CUDA backend's Python path's two) for the fused and the
    plain step and prints a row for each (speed is not asserted)."""
    from tensorstep.bench import cuda_host

    cuda_host.main(["--stub", "--batch", "2", "--calls", "1", "--rounds", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith(("fused:", "plain:"))]
    assert [r[0] for r in rows] == ["fused:", "plain:"]
    for r in rows:
        native, direct, cupy = float(r[2]), float(r[4]), float(r[6])
        over_native, over_direct = float(r[10]), float(r[14])
        assert native > 0 and direct > 0 and cupy > 0
        assert abs(over_native - direct / native) <= 0.01 + 0.01 * over_native
        assert abs(over_direct - cupy / direct) <= 0.01 + 0.01 * over_direct
