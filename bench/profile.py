"""`tensorstep bench --profile`: where a call's time goes, op by op, under torch.profiler.

For each case of the costs bench (bench/costs.py: float32, H=32, D=7, seven terms, P written; B=400
unless --batch), forward+backward of the fused step with its cost parameters passed and held, of the
plain step plus the same costs in eager PyTorch, and of the plain step alone (a gradient on P), as
that bench builds them: a few calls to warm up, then ``CALLS`` calls under ``torch.profiler``. Per
call (averaged over the calls: one that loses its core on a busy machine raises its ops' figures),
each op's self host time and, on CUDA, the self device time of the kernels it launched (the
profiler's own cost is in the host times: compare methods with each other, time them with
``bench --scheme costs``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.profiler import ProfilerActivity

from .costs import CostCase, case_callables
from .harness import _sync, machine

#: the costs bench's methods profiled, and their names in its table
METHODS = {"fused": "(a) fused", "fused_held": "(a') fused, parameters held", "unfused": "(b) unfused + eager costs",
           "plain": "(d) step alone, gradient on P"}
#: calls profiled per method, after WARM_UP calls
CALLS = 20
WARM_UP = 5


def _device_us(event: Any) -> float:
    """An averaged event's self device time in µs (the attribute's name changed across PyTorch releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def table(events: Iterable[Any], calls: int, rows: int, device: bool) -> list[str]:
    """Markdown rows of the ``rows`` ops of most self time (host, or device where ``device``), per call."""
    ranked = sorted(events, key=lambda e: _device_us(e) if device else e.self_cpu_time_total, reverse=True)
    head = "| op | calls per call | self host µs per call |" + (" self device µs per call |" if device else "")
    lines = [head, "|---|---:|---:|" + ("---:|" if device else "")]
    for e in ranked[:rows]:
        cells = [e.key.replace("|", "/"), f"{e.count / calls:g}", f"{e.self_cpu_time_total / calls:.1f}"]
        if device:
            cells.append(f"{_device_us(e) / calls:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    host = sum(e.self_cpu_time_total for e in events) / calls
    lines.append(f"\nself host time of every op, per call: {host:.1f} µs" +
                 (f"; self device time: {sum(_device_us(e) for e in events) / calls:.1f} µs" if device else ""))
    return lines


def run_cases(cases: Iterable[CostCase], echo: Callable[[str], None], rows: int = 12) -> None:
    """Profile each case's methods and print a table per method."""
    echo(f"machine: {machine()}")
    for case in cases:
        cuda = case.device.startswith("cuda")
        methods = case_callables(case, inductor=False, echo=echo)
        for name, title in METHODS.items():
            run = methods[name]
            for _ in range(WARM_UP):
                run()
            _sync(case.device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(CALLS):
                    run()
                _sync(case.device)
            echo(f"\n{title}: B={case.batch}, H={case.horizon}, {case.dtype}, {case.device}; "
                 f"{CALLS} forward+backward calls profiled")
            for line in table(prof.key_averages(), CALLS, rows, cuda):
                echo(line)
