"""Issue 39's B=40000 target with more than one intra-op thread: the fused call (a), the copy
bound with outputs allocated as (a)'s (f), the step alone (d) and the fused kernels, exactly as
``tensorstep bench --scheme costs`` builds them (bench/costs.py ``case_callables``), with one
and with two threads. Wall time for every thread count (the thread's CPU time leaves out the
other threads' share), so the figures move with the machine's load: one process, the thread
count alternating round by round (``torch.set_num_threads``: PyTorch's operators and the
kernels' OpenMP regions share one libgomp), every method timed in every round; each round's
(a)/(f) is printed with the range over rounds, and the process's CPU time per wall second (how
many cores a method kept busy: about the thread count on an idle machine, less where other work
holds the cores). Before timing, the fused call's outputs and gradient with each thread count
are compared bit for bit with one thread's.

    OMP_NUM_THREADS=1 python -m tensorstep.bench.costs_threads [B ...] [--rounds N] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from . import costs
from .harness import format_time

#: what is timed (bench/costs.py's method names) and how it is printed
METHODS = {"fused": "(a) fused", "copy_as_outputs": "(f) copy bound, outputs as (a)'s", "plain": "(d) step alone",
           "kernel_forward": "forward kernel", "kernel_adjoint": "adjoint kernel"}


def same_bits(case: costs.CostCase, threads: Sequence[int]) -> bool:
    """Whether the fused call's P, cost and u's gradient are the same bits with every thread count."""
    step = costs.ts.load(case.fused, torch.device(case.device))
    gen, u, starts = costs._inputs(case)
    params = costs.parameters(case, gen)
    u.requires_grad_(True)
    W = torch.randn(case.batch, case.horizon, case.dof, generator=gen, dtype=case.torch_dtype).to(case.device)
    results = []
    for n in threads:
        torch.set_num_threads(n)
        u.grad = None
        P, cost = step(u, *starts, costs.DT, **params)
        torch.autograd.backward((P, cost), (W, torch.ones_like(cost)))
        results.append((P.detach(), cost.detach(), u.grad.clone()))
    return all(torch.equal(x, y) for r in results[1:] for x, y in zip(results[0], r))


def measure(methods: dict[str, Callable[[], object]], threads: Sequence[int], rounds: int,
            budget_s: float = 0.1) -> tuple[dict, dict]:
    """Wall seconds per call and process CPU seconds per wall second of each method with each
    thread count, one sample per round: ``{(threads, method): [per round]}`` for both. Each
    sample is one untimed call, then calls until ``budget_s`` has passed (at least one)."""
    for fn in methods.values():  # warm up (allocator, the native node's first calls)
        fn()
    wall = {(n, name): [] for n in threads for name in methods}
    busy = {(n, name): [] for n in threads for name in methods}
    for r in range(rounds):
        for n in (threads if r % 2 == 0 else threads[::-1]):  # each thread count first in every other round
            torch.set_num_threads(n)
            for name, fn in methods.items():
                fn()
                calls, w0, c0 = 0, time.perf_counter(), time.process_time()
                while True:
                    fn()
                    calls += 1
                    w = time.perf_counter() - w0
                    if w >= budget_s:
                        break
                wall[n, name].append(w / calls)
                busy[n, name].append((time.process_time() - c0) / w)
    return wall, busy


def spread(values: Sequence[float], show: Callable[[float], str]) -> str:
    """The median and the range of a method's samples."""
    return f"{show(statistics.median(values))} ({show(min(values))}–{show(max(values))})"


def report(case: costs.CostCase, threads: Sequence[int], rounds: int, echo: Callable[[str], None],
           budget_s: float = 0.1) -> dict:
    """Measure one case and print its table; returns the samples (``measure``)."""
    methods = costs.case_callables(case, inductor=False)
    methods = {name: methods[name] for name in METHODS}
    identical = same_bits(case, threads)
    wall, busy = measure(methods, threads, rounds, budget_s)
    ratio = lambda x: f"{x:.2f}×"
    echo(f"\nB={case.batch} {case.dtype}, H={case.horizon}, D={case.dof}: wall time per call, median (range) of "
         f"{rounds} rounds; fused call the same bits with {', '.join(map(str, threads))} threads: "
         f"{'yes' if identical else 'NO'}\n")
    echo("| threads | method | wall time per call | CPU time per wall second |")
    echo("|---|---|---|---|")
    for n in threads:
        for name, label in METHODS.items():
            echo(f"| {n} | {label} | {spread(wall[n, name], format_time)} | {statistics.median(busy[n, name]):.2f} |")
        per_round = [a / f for a, f in zip(wall[n, "fused"], wall[n, "copy_as_outputs"])]
        echo(f"| {n} | (a) / (f), round by round | {spread(per_round, ratio)} | |")
    for n in threads[1:]:
        for name, label in METHODS.items():
            gain = [a / b for a, b in zip(wall[threads[0], name], wall[n, name])]
            echo(f"{label}: {threads[0]} thread(s) / {n} threads, round by round: {spread(gain, ratio)}")
    if not identical:
        raise RuntimeError(f"the fused call's results differ between {threads} threads")
    return {"wall": wall, "busy": busy}


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorstep.bench.costs_threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", nargs="*", type=int, default=[40000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--budget", type=float, default=0.1, help="seconds of calls per sample (default 0.1)")
    args = parser.parse_args(list(argv))
    threads = [int(n) for n in args.threads.split(",")]
    before = torch.get_num_threads()
    try:
        for batch in args.batch:
            report(costs.CostCase(batch), threads, args.rounds, print, args.budget)
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
