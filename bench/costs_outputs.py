"""A fused step's kernels and their new outputs: each kernel, and a copy of the bytes it writes,
into outputs allocated as PyTorch allocates them (``torch.empty``: above glibc's mmap threshold,
new memory page-faulted in 4 KiB at a time), as the runtime allocates them (``memory.empty``:
runtime/memory.py, huge pages from 4 MiB on), and into outputs kept from call to call (no
allocation). The case is ``tensorstep bench --scheme costs``'s; one process, the variants
interleaved (bench/harness.py), this thread's CPU time with one thread; page faults per call
from ``getrusage``.

    OMP_NUM_THREADS=1 python -m tensorstep.bench.costs_outputs [B ...]    # default: 400 40000
"""
from __future__ import annotations

import resource
import sys
from typing import Callable, Optional, Sequence

import torch

import tensorstep as ts
from tensorstep.runtime import memory
from tensorstep.runtime.launch import ptr

from . import costs
from .compiled import clock
from .harness import DT, format_time, time_interleaved

Allocate = Callable[[Sequence[int]], torch.Tensor]


def allocations(case: costs.CostCase) -> dict[str, Optional[Allocate]]:
    """How each variant gets its outputs (None: kept from call to call)."""
    dtype, device = case.torch_dtype, torch.device(case.device)
    return {"torch.empty": lambda shape: torch.empty(shape, dtype=dtype, device=device),
            "memory.empty": lambda shape: memory.empty(shape, dtype, device),
            "kept": None}


def callables(case: costs.CostCase, W: Optional[torch.Tensor] = None) -> dict[str, Callable[[], list]]:
    """Each kernel and each copy, once per allocation, as a no-argument callable returning what it
    wrote; the adjoint takes the gradient of ``sum(P · W) + sum(cost)`` (W random unless given)."""
    fused = ts.load(case.fused, torch.device(case.device))
    gen, u, starts = costs._inputs(case)
    params = costs.parameters(case, gen)
    inputs = [None if x is None else x.detach()
              for x in costs.kernel_inputs(fused, costs.table_values(fused.table, u, starts, params))]
    B, launcher = case.batch, fused.launcher
    dt = fused._dt_tensor(DT, B)
    if W is None:
        W = torch.randn(B, case.horizon, case.dof, generator=gen, dtype=case.torch_dtype).to(case.device)
    ones = torch.ones(B, len(costs.TERMS), dtype=case.torch_dtype, device=case.device)
    output_shapes, gradient_shape = launcher.output_shapes(B), launcher.action_shape(B)
    others = [0] * (len(launcher.table.differentiable) - 1)  # the gradients not asked for (as in the bench)

    def forward(outputs: Callable[[], list]) -> Callable[[], list]:
        return lambda: launcher.forward(inputs, dt, out=outputs())

    def adjoint(gradient: Callable[[], torch.Tensor]) -> Callable[[], list]:
        def run() -> list:  # Launcher.adjoint's arguments, into the given gradient
            gu = gradient()
            launcher.backend.call("adjoint", B, [*map(ptr, inputs), ptr(W), ptr(ones), ptr(dt), ptr(gu), *others])
            return [gu]

        return run

    def copy(source: torch.Tensor, target: Callable[[], torch.Tensor]) -> Callable[[], list]:
        return lambda: [target().copy_(source)]

    written = sum(torch.Size(s).numel() for s in output_shapes)
    sources = {"forward": torch.randn(written, generator=gen, dtype=case.torch_dtype).to(case.device),
               "adjoint": torch.randn(torch.Size(gradient_shape).numel(), generator=gen,
                                      dtype=case.torch_dtype).to(case.device)}
    out = {}
    for name, allocate in allocations(case).items():
        if allocate is None:
            kept = [torch.empty(s, dtype=case.torch_dtype, device=case.device) for s in output_shapes]
            gu = torch.empty(gradient_shape, dtype=case.torch_dtype, device=case.device)
            targets = {k: torch.empty_like(v) for k, v in sources.items()}
            outputs, gradient, target = (lambda: kept), (lambda: gu), targets.__getitem__
        else:
            outputs = lambda allocate=allocate: [allocate(s) for s in output_shapes]
            gradient = lambda allocate=allocate: allocate(gradient_shape)
            target = lambda k, allocate=allocate: allocate(sources[k].shape)
        out[f"forward kernel, {name}"] = forward(outputs)
        out[f"adjoint kernel, {name}"] = adjoint(gradient)
        for k, source in sources.items():
            out[f"copy of the {k}'s outputs, {name}"] = copy(source, lambda k=k, target=target: target(k))
    return out


def page_faults(fn: Callable[[], object], calls: int = 3) -> float:
    """Minor page faults per call of ``fn`` (after one call)."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def main(argv: Sequence[str] = ()) -> int:
    timer, timer_name = clock()
    for batch in [int(b) for b in argv] or [400, 40000]:
        case = costs.CostCase(batch)
        methods = callables(case)
        t = time_interleaved(methods, case.device, 1.5, clock=timer)
        print(f"\nB={batch} ({timer_name}; median of 7 interleaved rounds):\n")
        print("| | time per call | per trajectory | page faults per call |")
        print("|---|---|---|---|")
        for name, fn in methods.items():
            print(f"| {name} | {format_time(t[name])} | {t[name] / batch * 1e9:.0f} ns | {page_faults(fn):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
