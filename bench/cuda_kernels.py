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

``--min-blocks 2,3,4 [--rounds R]``: the same kernels with the fused forward's and adjoint's
``__launch_bounds__(256, n)`` asking for n resident blocks (codegen/targets.py CUDA_MORE_BLOCKS set
to n for both, both dtypes; the plain step's kernels keep theirs, a control for the noise): each n
in a process of its own with a kernel cache of its own (the cache and the loaded libraries are keyed
by spec, not by bounds), the n in turn, R rounds (default 2); each cell the median over the rounds,
with their range.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from .launch_bounds import take_option

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


@contextlib.contextmanager
def min_blocks(blocks: int) -> Iterator[None]:
    """Every fused forward and adjoint generated inside asks for ``blocks`` resident blocks (the
    rule of codegen/targets.py replaced; the unfused kernels keep CUDA_MIN_BLOCKS)."""
    from ..codegen import targets

    rule = tuple((dtype, kernel, kind, sys.maxsize, blocks)
                 for dtype in DTYPES for kernel in ("forward", "adjoint") for kind in ("rows", "spans"))
    kept = targets.CUDA_MORE_BLOCKS
    targets.CUDA_MORE_BLOCKS = rule
    try:
        yield
    finally:
        targets.CUDA_MORE_BLOCKS = kept


def fused_bounds(dtype: str) -> dict[str, tuple[int, int]]:
    """The bench's fused forward's and adjoint's ``__launch_bounds__`` as generated now."""
    from ..codegen.driver import generate
    from .costs import CostCase

    spec = CostCase(batch=1, dtype=dtype).fused
    source = generate(spec, targets=("cuda",), parts=("core",)).source("cuda", "core")
    found = {}
    for kernel in ("forward", "adjoint"):
        bound = re.search(rf"__launch_bounds__\((\d+), (\d+)\) void {spec.name}_{kernel}\(", source)
        found[kernel] = (int(bound[1]), int(bound[2]))
    return found


def child_command(blocks: int, batches: Sequence[int]) -> list[str]:
    """The command that times the kernels at ``blocks`` (``--at-min-blocks``) in a process of its own."""
    return [sys.executable, "-m", "tensorstep.bench.cuda_kernels", "--at-min-blocks", str(blocks),
            *(str(b) for b in batches)]


#: the line a child prints its rows on (as JSON)
ROWS = "cuda_kernels rows: "


def at_min_blocks(blocks: int, batches: Sequence[int], device: torch.device) -> list[Row]:
    """Each dtype's and batch's rows with the fused kernels at ``blocks`` (checked in the source)."""
    with min_blocks(blocks):
        for dtype in DTYPES:
            found = fused_bounds(dtype)
            if any(b != blocks for _, b in found.values()):
                raise RuntimeError(f"the fused kernels' bounds are {found}, not {blocks} blocks")
        return [row for dtype in DTYPES for batch in batches for row in measure(batch, dtype, device)]


def run_child(blocks: int, batches: Sequence[int], cache: str) -> list[Row]:
    """``child_command`` run with its own kernel cache; its rows."""
    env = {**os.environ, "TENSORSTEP_CACHE_DIR": cache}
    done = subprocess.run(child_command(blocks, batches), env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(ROWS)]
    if done.returncode or not lines:
        raise RuntimeError(f"min blocks {blocks}: the child failed ({done.returncode}): {done.stderr[-2000:]}")
    return [Row(**r) for r in json.loads(lines[-1][len(ROWS):])]


def blocks_table(runs: dict[int, list[list[Row]]]) -> list[str]:
    """A row per kernel, a column per n: the median over the rounds (µs) with their range, and
    each n's time as a fraction of the first n's."""
    ns = list(runs)
    lines = ["| step | kernel | dtype | B | " + " | ".join(f"n={n} (µs)" for n in ns) + " | "
             + " | ".join(f"n={n} / n={ns[0]}" for n in ns[1:]) + " |",
             "|---|---|---|---:|" + "---:|" * (2 * len(ns) - 1)]
    first = runs[ns[0]][0]
    for i, r in enumerate(first):
        medians, cells = [], []
        for n in ns:
            times = [rows[i].microseconds for rows in runs[n]]
            medians.append(statistics.median(times))
            cells.append(f"{medians[-1]:.1f} ({min(times):.1f}–{max(times):.1f})" if len(times) > 1
                         else f"{medians[-1]:.1f}")
        ratios = [f"{m / medians[0]:.2f}" for m in medians[1:]]
        lines.append(f"| {r.step} | {r.kernel} | {r.dtype} | {r.batch} | " + " | ".join(cells + ratios) + " |")
    return lines


def no_gpu() -> Optional[str]:
    """Why nothing can be timed here, or None."""
    if not torch.cuda.is_available():
        return "cuda_kernels: no CUDA device here (torch.cuda.is_available() is False): nothing timed"
    try:
        import cupy  # noqa: F401  (the runtime's CUDA backend)
    except ImportError:
        return "cuda_kernels: CuPy is not installed (the CUDA backend needs it): nothing timed"
    return None


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    child = take_option(args, "--at-min-blocks")
    blocks = take_option(args, "--min-blocks")
    rounds = int(take_option(args, "--rounds") or 2)
    batches = [int(a) for a in args] or [400, 40000]
    why = no_gpu()
    if why:
        print(why)
        return 0
    device = torch.device("cuda")
    header = (f"# {torch.cuda.get_device_name(device)}; median of {RUNS} launches after {WARMUPS} warm-ups, "
              "CUDA events behind a spin kernel")
    if child is not None:
        rows = at_min_blocks(int(child), batches, device)
        print(ROWS + json.dumps([dataclasses.asdict(r) for r in rows]))
        return 0
    if blocks is not None:
        ns = [int(n) for n in blocks.split(",")]
        runs: dict[int, list[list[Row]]] = {n: [] for n in ns}
        with tempfile.TemporaryDirectory(prefix="tensorstep-min-blocks-") as caches:
            for _ in range(rounds):
                for n in ns:  # interleaved: each round every n in turn, each n's cache kept across rounds
                    runs[n].append(run_child(n, batches, os.path.join(caches, f"n{n}")))
        print(header + f"; fused forward and adjoint at n resident blocks, {rounds} rounds")
        print("\n".join(blocks_table(runs)))
        return 0
    rows = [row for dtype in DTYPES for batch in batches for row in measure(batch, dtype, device)]
    print(header)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
