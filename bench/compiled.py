"""`tensorstep bench --compiled-loss`: a loss that calls a step, eager and under torch.compile.

Users compile their whole cost function, so what matters is what the step adds to a compiled
call. torch.compile has a per-call cost of its own (guards, AOTAutograd's wrappers), which a
tiny loss ``(u * 2).square().sum()`` over the same actions shows: the step's share of a call is
the loss's time minus the tiny loss's, eager and compiled, all four timed in one interleaved run.
The first compile is timed in fresh processes (PyTorch's own start-up included, as a user's
first compile has it), for the loss and for the tiny loss.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

import tensorstep as ts
from tensorstep.runtime import native

from .harness import DT, format_time, machine, time_interleaved

LOSS = "P.square().sum() + 0.1 * J.square().sum()"
TINY = "(u * 2).square().sum()"
DOF = 7


def losses(step: Callable) -> dict[str, Callable]:
    """The loss over a step's outputs, and the tiny loss (torch.compile's own per-call floor)."""

    def loss(u, p0, v0, a0):
        P, V, A, J = step(u, p0, v0, a0, DT)
        return P.square().sum() + 0.1 * J.square().sum()

    def tiny(u, p0, v0, a0):
        return (u * 2).square().sum()

    return {"loss": loss, "tiny": tiny}


def _fwd_bwd(fn: Callable, u: torch.Tensor, starts: list) -> Callable[[], None]:
    def run() -> None:
        u.grad = None
        fn(u, *starts).backward()

    return run


def callables(batch: int, horizon: int) -> dict[str, Callable[[], None]]:
    """Forward+backward of the loss and the tiny loss, eager and compiled (fullgraph), compiled
    here before any timing."""
    step = ts.load(ts.KernelSpec(horizon=horizon, dof=DOF))
    native.wait()  # eager calls take the native node, as they do once it is built
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(step.action_shape(batch), generator=gen).requires_grad_(True)
    starts = [torch.randn(batch, DOF, generator=gen) for _ in range(3)]
    torch._dynamo.reset()  # this case's shapes compile afresh: no recompile limit, no stale guards
    methods = {}
    for name, fn in losses(step).items():
        methods[f"eager {name}"] = _fwd_bwd(fn, u, starts)
        methods[f"compiled {name}"] = _fwd_bwd(torch.compile(fn, fullgraph=True), u, starts)
        methods[f"compiled {name}"]()  # compiles the forward and backward graphs
    return methods


def clock() -> tuple[Callable[[], float], str]:
    """This thread's CPU time when the work runs on it alone (one intra-op thread): on a shared
    machine another process's load then does not count; else wall time."""
    if torch.get_num_threads() == 1:
        return time.thread_time, "CPU time of the calling thread"
    return time.perf_counter, "wall time"


def run(batches: tuple, horizon: int, echo: Callable[[str], None], budget_s: float = 0.6, repeats: int = 7,
        compile_cost: bool = True) -> list[dict]:
    """The compiled-loss table, and (``compile_cost``) the first compile in fresh processes."""
    timer, timer_name = clock()
    echo(f"machine: {machine()}; eager steps on the {'native node' if native.wait() else 'Python autograd path'}")
    echo(f"loss = {LOSS} over P, V, A, J = step(u, p0, v0, a0, dt) (H={horizon}, D={DOF}, float32); "
         f"tiny = {TINY}; forward+backward, median of {repeats} interleaved rounds ({timer_name})")
    echo("")
    echo("| B | eager loss | eager tiny | compiled loss | compiled tiny | step's share eager | step's share compiled "
         "| compiled / eager share |")
    echo("|---|---|---|---|---|---|---|---|")
    rows = []
    for batch in batches:
        t = time_interleaved(callables(batch, horizon), "cpu", budget_s, repeats, timer)
        eager = t["eager loss"] - t["eager tiny"]
        compiled = t["compiled loss"] - t["compiled tiny"]
        rows.append(dict(batch=batch, **t))
        echo(f"| {batch} | {format_time(t['eager loss'])} | {format_time(t['eager tiny'])} | "
             f"{format_time(t['compiled loss'])} | {format_time(t['compiled tiny'])} | {format_time(eager)} | "
             f"{format_time(compiled)} | {compiled / eager:.2f}× |")
    if compile_cost:
        first_compile(horizon, echo)
    return rows


# a fresh process: import, load, then time the first call (compile + forward + backward) of one loss
FIRST_COMPILE = """
import sys, time, torch
import tensorstep as ts
from tensorstep.bench.compiled import DOF, losses
from tensorstep.runtime import native
step = ts.load(ts.KernelSpec(horizon={H}, dof=DOF))
native.wait()
step(torch.zeros(step.action_shape(1)), *(torch.zeros(1, DOF) for _ in range(3)), 0.02)
u = torch.randn(step.action_shape(8)).requires_grad_(True)
starts = [torch.randn(8, DOF) for _ in range(3)]
fn = torch.compile(losses(step)[sys.argv[1]], fullgraph=True)
t0, c0 = time.perf_counter(), time.process_time()
fn(u, *starts).backward()
print(time.perf_counter() - t0, time.process_time() - c0)
"""


def first_compile(horizon: int, echo: Callable[[str], None]) -> dict[str, list[tuple[float, float]]]:
    """The first compiled call (B=8) in a fresh process, for the loss and the tiny loss: with
    torch.compile's disk caches empty (a new user), then again with them filled by the first run."""
    echo("\nFirst call of torch.compile(fullgraph=True), forward+backward at B=8, each in a fresh process "
         "(wall s / this process's CPU s; compiler subprocesses are not in the CPU figure):")
    echo("")
    echo("| loss | empty inductor cache | filled cache (second process) |")
    echo("|---|---|---|")
    found: dict[str, list[tuple[float, float]]] = {}
    for name in ("loss", "tiny"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            times = []
            for _ in range(2):
                done = subprocess.run([sys.executable, "-c", FIRST_COMPILE.format(H=horizon), name], env=env,
                                      capture_output=True, text=True)
                if done.returncode:
                    echo(f"| {name} | failed: {done.stderr.strip()[-300:]} | |")
                    break
                wall, cpu = map(float, done.stdout.split()[-2:])
                times.append((wall, cpu))
            if len(times) == 2:
                found[name] = times
                echo(f"| {LOSS if name == 'loss' else TINY} | {times[0][0]:.1f} s / {times[0][1]:.1f} s "
                     f"| {times[1][0]:.1f} s / {times[1][1]:.1f} s |")
    return found
