"""``python -m tensorstep.bench.cuda_kernels B...``: each per-element CUDA kernel of the bench's fused
step (bench/costs.py: seven cost terms, P written) and of the plain step of the same shape (H=32,
D=7), float32 and float64, timed alone on the GPU against a device-to-device copy of the same bytes.

A kernel is launched through the runtime's launcher, as ``bench --scheme costs`` times its kernels
alone (the fused forward's launch is the forward and cost_sum, which adds its dof columns' sums):
5 warm-ups, then 50 launches, each between two CUDA events recorded behind a spin kernel
(``torch.cuda._sleep``), so that the events time the GPU's work and not the host's launch; the
median is reported. "Bytes" are what the kernel must move: the tensors it reads and writes at the
call's interface (u, the start states, the per-trajectory cost weights, the outputs, the incoming
and outgoing gradients; not the fused forward's per-column partial sums). The copy is
``torch.empty_like(x).copy_(x)`` of half those bytes (it reads and writes them), timed the same way.
Without a GPU (or CuPy) it prints why and exits 0.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Callable, Iterable, Optional, Sequence

import torch

#: launches timed, after the warm-ups
RUNS = 50
WARMUPS = 5
#: the spin before each timed launch (GPU cycles): longer than the host's launch path
SPIN_CYCLES = 400_000
DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class Row:
    """One kernel's median time (µs), the bytes it must move, and a copy's median time of those bytes."""

    step: str
    kernel: str
    dtype: str
    batch: int
    microseconds: float
    bytes: int
    copy_microseconds: float

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes / self.microseconds / 1e3

    @property
    def of_copy(self) -> float:
        """The fraction of the copy's throughput the kernel reaches (copy time / kernel time)."""
        return self.copy_microseconds / self.microseconds


HEADER = ("| step | kernel | dtype | B | µs | bytes it must move (MB) | GB/s | copy of the same bytes (µs) "
          "| fraction of the copy |")


def table(rows: Iterable[Row]) -> list[str]:
    """The rows as a Markdown table."""
    lines = [HEADER, "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.step} | {r.kernel} | {r.dtype} | {r.batch} | {r.microseconds:.1f} | {r.bytes / 1e6:.1f} "
                     f"| {r.gigabytes_per_second:.0f} | {r.copy_microseconds:.1f} | {r.of_copy:.0%} |")
    return lines


def median_microseconds(launch: Callable[[], object], runs: int = RUNS, warmups: int = WARMUPS) -> float:
    """The median GPU time of ``launch`` (µs): each run between two events behind a spin kernel."""
    for _ in range(warmups):
        launch()
    pairs = []
    for _ in range(runs):
        torch.cuda._sleep(SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def _nbytes(tensors: Sequence[Optional[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _copy_microseconds(nbytes: int, device: torch.device) -> float:
    x = torch.ones(max(1, nbytes // 2 // 4), dtype=torch.float32, device=device)
    return median_microseconds(lambda: torch.empty_like(x).copy_(x))


def measure(batch: int, dtype: str, device: torch.device) -> list[Row]:
    """The fused step's forward (+ cost_sum) and adjoint, the plain step's forward and adjoint."""
    import tensorstep as ts

    from .costs import CostCase, _inputs, kernel_inputs, parameters, table_values
    from .harness import DT

    case = CostCase(batch=batch, dtype=dtype, device=str(device))
    gen, u, starts = _inputs(case)
    params = parameters(case, gen)
    W = torch.randn(batch, case.horizon, case.dof, generator=gen, dtype=case.torch_dtype).to(device)
    fused, plain = ts.load(case.fused, device), ts.load(case.plain, device)
    ones = torch.ones(batch, len(case.fused.costs), dtype=case.torch_dtype, device=device)
    inputs = [None if x is None else x.detach() for x in kernel_inputs(fused, table_values(fused.table, u, starts, params))]
    dt = fused._dt_tensor(DT, batch)
    needed = (True,) + (False,) * (len(fused.table.differentiable) - 1)
    f_out = fused.launcher.forward(inputs, dt)
    f_grads = fused.launcher.adjoint((W, ones), dt, batch, needed, inputs)
    p_inputs = [u, *starts, None, None]
    p_out = plain.launcher.forward(p_inputs, dt)
    p_dt = plain._dt_tensor(DT)
    no_grads = (None,) * case.plain.order
    p_needed = (False,) * len(plain.table.differentiable)
    p_grads = plain.launcher.adjoint((W, *no_grads), p_dt, batch, p_needed)
    launches = [
        ("fused", "forward + cost_sum", lambda: fused.launcher.forward(inputs, dt, out=f_out), _nbytes([*inputs, *f_out])),
        ("fused", "adjoint", lambda: fused.launcher.adjoint((W, ones), dt, batch, needed, inputs),
         _nbytes([*inputs, W, ones, *f_grads])),
        ("plain", "forward", lambda: plain.launcher.forward(p_inputs, p_dt, out=p_out), _nbytes([*p_inputs, *p_out])),
        ("plain", "adjoint", lambda: plain.launcher.adjoint((W, *no_grads), p_dt, batch, p_needed),
         _nbytes([W, *p_grads])),
    ]
    return [Row(step, kernel, dtype, batch, median_microseconds(launch), nbytes, _copy_microseconds(nbytes, device))
            for step, kernel, launch, nbytes in launches]


def main(argv: Sequence[str]) -> int:
    batches = [int(a) for a in argv] or [400, 40000]
    if not torch.cuda.is_available():
        print("cuda_kernels: no CUDA device here (torch.cuda.is_available() is False): nothing timed")
        return 0
    try:
        import cupy  # noqa: F401  (the runtime's CUDA backend)
    except ImportError:
        print("cuda_kernels: CuPy is not installed (the CUDA backend needs it): nothing timed")
        return 0
    device = torch.device("cuda")
    rows = [row for dtype in DTYPES for batch in batches for row in measure(batch, dtype, device)]
    print(f"# {torch.cuda.get_device_name(device)}; median of {RUNS} launches after {WARMUPS} warm-ups, "
          "CUDA events behind a spin kernel")
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
