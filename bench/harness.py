"""`tensorstep bench`: forward+backward timings against the baselines, in one interleaved run."""
from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable, Optional

import torch

import tensorstep as ts

from .baselines import copy_elements, copy_source, dense_step, slicing_step

SCHEMES = {
    "central": dict(control="position", difference="central"),
    "backward": dict(control="position", difference="backward"),
    "accel": dict(control="acceleration", integrator="semi_implicit_euler"),
}
DT = 0.02
#: torch.compile backend of the compiled slicing baseline (what a user would write instead)
COMPILE_BACKEND = "inductor"


@dataclasses.dataclass
class Case:
    scheme: str
    horizon: int
    batch: int
    dtype: str
    device: str = "cpu"
    dof: int = 7

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "float32" else torch.float64

    @property
    def spec(self) -> ts.KernelSpec:
        return ts.KernelSpec(horizon=self.horizon, dof=self.dof, dtype=self.dtype, **SCHEMES[self.scheme])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine_backward(outs, grads) -> None:
    """torch.autograd.backward without its Python wrapper (whose argument checks cost ~10 µs per
    output here): the outputs go to the autograd engine directly."""
    torch.autograd.Variable._execution_engine.run_backward(tuple(outs), tuple(grads), False, False, (), True, True)


def _fwd_bwd(step: Callable, u, starts, grads, backward: Callable = torch.autograd.backward) -> Callable[[], None]:
    def run() -> None:
        u.grad = None  # as optimizer.zero_grad(set_to_none=True): no accumulation pass
        outs = step(u, *starts)
        backward(outs, grads)

    return run


def _inputs(case: Case) -> tuple[torch.Generator, torch.Tensor, list[torch.Tensor]]:
    """A seeded generator (for further random tensors) and the case's actions and start state."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(case.batch, case.horizon - 1, case.dof, generator=gen, dtype=case.torch_dtype).to(case.device)
    starts = [torch.randn(case.batch, case.dof, generator=gen, dtype=case.torch_dtype).to(case.device)
              for _ in range(3)]
    return gen, u, starts


def compiled_slicing(spec: ts.KernelSpec, run: Callable[[Callable], Callable[[], None]]) -> Optional[Callable[[], None]]:
    """The slicing baseline under torch.compile, compiled for this case's shapes here, before any
    timing (None where the slicing baseline does not cover the spec). ``run`` wraps a step into
    the timed forward+backward callable."""
    try:
        fn = slicing_step(spec, DT)
    except ValueError:
        return None
    torch._dynamo.reset()  # one compiled graph per case: no recompile limit, no stale guards
    timed = run(torch.compile(fn, backend=COMPILE_BACKEND, dynamic=False))
    timed()  # compiles the forward and backward graphs
    timed()
    return timed


def case_callables(case: Case, inductor: bool = True) -> dict[str, Callable[[], None]]:
    """Each method's forward+backward as a no-argument callable (inputs prepared once); with
    ``inductor``, the slicing baseline under torch.compile too."""
    spec = case.spec
    dtype = case.torch_dtype
    dev = torch.device(case.device)
    B, D, H = case.batch, case.dof, case.horizon
    gen, u, starts = _inputs(case)
    u.requires_grad_(True)
    grads = tuple(torch.randn(B, H, D, generator=gen, dtype=dtype).to(dev) for _ in range(spec.order + 1))
    step = ts.load(spec, dev)
    launcher = step.launcher
    dt_k = torch.full((1,), DT, dtype=dtype, device=dev)

    def kernels() -> None:  # the generated forward and adjoint launched directly (no autograd)
        launcher.forward([u.detach(), *starts, None, None], dt_k)
        launcher.adjoint(grads, dt_k, B, (False,) * 5)

    methods = {
        "tensorstep": _fwd_bwd(lambda u, *s: step(u, *s, DT), u, starts, grads),
        "kernels": kernels,
        "dense": _fwd_bwd(dense_step(spec, DT, dtype, dev), u, starts, grads),
    }
    if step.native is not None:  # the same kernels behind the Python autograd.Function
        python_step = ts.load(spec, dev)
        python_step.native = None
        methods["python"] = _fwd_bwd(lambda u, *s: python_step(u, *s, DT), u, starts, grads)
    try:
        methods["slicing"] = _fwd_bwd(slicing_step(spec, DT), u, starts, grads)
    except ValueError:
        pass
    compiled = compiled_slicing(spec, lambda fn: _fwd_bwd(fn, u, starts, grads)) if inductor else None
    if compiled is not None:
        methods["compiled"] = compiled
    src = copy_source(copy_elements(spec, B), dtype, dev)
    methods["copy"] = lambda: src.clone()
    if B == 1 and case.device == "cpu":
        methods.update(autograd_floors())
        methods["engine_direct"] = _fwd_bwd(lambda u, *s: step(u, *s, DT), u, starts, grads, _engine_backward)
        dt_tensor = torch.tensor(DT, dtype=dtype)  # as cuRobo passes traj_dt
        methods["dt_tensor"] = _fwd_bwd(lambda u, *s: step(u, *s, dt_tensor), u, starts, grads)
    return methods


def time_interleaved(methods: dict[str, Callable[[], None]], device: str, budget_s: float = 0.6,
                     repeats: int = 7, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each method; methods take turns in every repeat, each turn
    starting with one untimed call (steady state, equally for every method), and each repeat
    starting one method further on, so that no method is always timed first or after the same
    one (on a CPU, a method's place in the round moved its time by up to a fifth). ``clock``:
    wall time, or e.g. the thread's CPU time."""
    for fn in methods.values():  # warm up (compiles, allocator)
        fn()
        fn()
    _sync(device)
    start = clock()
    for fn in methods.values():
        fn()
    _sync(device)
    one_round = max(clock() - start, 1e-6)
    inner = max(1, int(budget_s / repeats / one_round))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(repeats):
        first = r % len(names)
        for name in names[first:] + names[:first]:
            fn = methods[name]
            fn()  # untimed: the first call after another method pays for its cache and heap state
            _sync(device)
            t0 = clock()
            for _ in range(inner):
                fn()
            _sync(device)
            samples[name].append((clock() - t0) / inner)
    return {name: statistics.median(v) for name, v in samples.items()}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}; {os.cpu_count()} cores; torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        text += f"; GPU {torch.cuda.get_device_name()}"
    return text


def default_cases(device: str, quick: bool = False) -> list[Case]:
    batches = (1, 400, 4000) if quick else (1, 400, 4000, 40000)
    if device.startswith("cuda"):
        batches = (1, 400, 4000, 40000, 400000)
    cases = [Case(s, 32, b, "float32", device) for s in SCHEMES for b in batches]
    cases += [Case("central", 32, b, "float64", device) for b in batches[1:3]]
    cases += [Case("central", h, 400, "float32", device) for h in (8, 128, 256)]
    cases += [Case("accel", h, 400, "float32", device) for h in (8, 128, 256)]
    return cases


def format_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def _ratio(t: dict[str, float], baseline: str) -> str:
    return f"{t[baseline] / t['tensorstep']:.1f}×" if baseline in t else "n/a"


def run_cases(cases: Iterable[Case], echo: Callable[[str], None], budget_s: float = 0.6,
              inductor: bool = True) -> list[dict]:
    """The forward+backward table; with ``inductor``, the slicing baseline under torch.compile is a
    column of the same interleaved runs (compiled per case before its timing starts)."""
    rows = []
    echo(f"machine: {machine()}")
    echo("")
    echo("| scheme | H | B | dtype | tensorstep (autograd) | via Python autograd | kernels only | dense | slicing "
         "| slicing, torch.compile | copy bound | slicing / tensorstep | compiled slicing / tensorstep "
         "| tensorstep / copy |")
    echo("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        t = time_interleaved(case_callables(case, inductor), case.device, budget_s)
        row = dict(dataclasses.asdict(case), **t)
        rows.append(row)
        sl, co = t.get("slicing"), t.get("compiled")
        echo(
            f"| {case.scheme} | {case.horizon} | {case.batch} | {case.dtype} | {format_time(t['tensorstep'])} | "
            f"{format_time(t['python']) if 'python' in t else 'n/a'} | {format_time(t['kernels'])} | {format_time(t['dense'])} | {format_time(sl) if sl else 'n/a'} | "
            f"{format_time(co) if co else 'n/a'} | {format_time(t['copy'])} | {_ratio(t, 'slicing')} | "
            f"{_ratio(t, 'compiled')} | {t['tensorstep'] / t['copy']:.2f}× |"
        )
    floors = [r for r in rows if "floor_builtin_op" in r]
    if floors:
        echo("\nB=1 against this machine's autograd floor, timed in the same interleaved runs "
             "(forward+backward):")
    for r in floors:
        echo(f"* {r['scheme']} {r['dtype']}: tensorstep {format_time(r['tensorstep'])} (outputs handed to the engine "
             f"directly: {format_time(r['engine_direct'])}; dt as a tensor: {format_time(r['dt_tensor'])}); "
             f"one built-in op (x * 2) "
             f"{format_time(r['floor_builtin_op'])}; a trivial 4-output Python autograd.Function "
             f"{format_time(r['floor_python_function'])}")
    return rows


def rollout_callables(case: Case) -> dict[str, Callable[[], None]]:
    """Forward only, no autograd (sampling-based planners such as MPPI): into new outputs, into
    reused ones (out=), the slicing baseline, and a copy of the bytes the forward moves into a
    preallocated buffer."""
    spec = case.spec
    dtype = case.torch_dtype
    dev = torch.device(case.device)
    gen, u, starts = _inputs(case)
    step = ts.load(spec, dev)
    out = tuple(torch.empty(step.launcher.output_shape(case.batch), dtype=dtype, device=dev)
                for _ in range(spec.order + 1))
    slicing = slicing_step(spec, DT)
    src = torch.randn(copy_elements(spec, case.batch) // 2, generator=gen, dtype=dtype).to(dev)
    dst = torch.empty_like(src)

    def no_grad(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn()
        return run

    return {
        "new": no_grad(lambda: step(u, *starts, DT)),
        "out": no_grad(lambda: step(u, *starts, DT, out=out)),
        "slicing": no_grad(lambda: slicing(u, *starts)),
        "copy": lambda: dst.copy_(src),
    }


def run_rollouts(cases: Iterable[Case], echo: Callable[[str], None], budget_s: float = 0.6) -> list[dict]:
    """The forward-only table (rollouts), for the position-difference and integration cases given."""
    echo("\nForward only (rollouts, under torch.no_grad), the same interleaved timing:")
    echo("")
    echo("| scheme | H | B | dtype | tensorstep, new outputs | tensorstep, out= | slicing | copy bound (preallocated) "
         "| slicing / out= | out= / copy |")
    echo("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        t = time_interleaved(rollout_callables(case), case.device, budget_s)
        rows.append(dict(dataclasses.asdict(case), **t))
        echo(f"| {case.scheme} | {case.horizon} | {case.batch} | {case.dtype} | {format_time(t['new'])} | "
             f"{format_time(t['out'])} | {format_time(t['slicing'])} | {format_time(t['copy'])} | "
             f"{t['slicing'] / t['out']:.1f}× | {t['out'] / t['copy']:.2f}× |")
    return rows


# torch is imported first, as in any process that uses a step (`import tensorstep` alone no longer
# imports it), so the columns are tensorstep's own cost
COLD_SNIPPET = """
import time, sys
import torch
t0 = time.perf_counter()
import tensorstep as ts
spec = ts.KernelSpec(horizon={H}, dof=7, **{kw})
t1 = time.perf_counter()
ts.load(spec)
t2 = time.perf_counter()
print(t2 - t1, "sympy" in sys.modules)
"""


NATIVE_SNIPPET = """
import time
from tensorstep.runtime import native
t0 = time.perf_counter()
path = native.library()
print(time.perf_counter() - t0, path.parent if path else "")
"""


def native_build(echo: Callable[[str], None], cache: str) -> Optional[str]:
    """Build the native autograd node in an empty cache (once per PyTorch install); its build folder.
    The cache is also the node's folder, so the user's own node is neither used nor touched."""
    env = dict(os.environ, TENSORSTEP_CACHE_DIR=cache, TENSORSTEP_NATIVE_DIR=cache)
    run = subprocess.run([sys.executable, "-c", NATIVE_SNIPPET], env=env, capture_output=True, text=True)
    parts = run.stdout.split()
    if run.returncode or len(parts) < 2:
        echo(f"\nnative autograd node: not built ({(run.stderr or 'disabled')[-200:].strip()})")
        return None
    echo(f"\nnative autograd node: built in {float(parts[0]):.1f} s (once per PyTorch install and compiler)")
    return parts[1]


def codegen_cost(echo: Callable[[str], None], horizons=(8, 32, 128, 256)) -> list[dict]:
    """Cold derive+render+compile and warm (cached) load per variant, each in a fresh process.

    Each cold cache already holds the native autograd node (built once per PyTorch install,
    timed on its own), so the cold column is the variant's own cost; warm loads include
    loading the node (median of three processes). All keep Python's bytecode cache, as a user's
    process would.
    """
    with tempfile.TemporaryDirectory() as native_cache:
        node = native_build(echo, native_cache)
        return _codegen_cost(echo, horizons, node)


def _codegen_cost(echo: Callable[[str], None], horizons, node: Optional[str]) -> list[dict]:
    echo("")
    echo("| variant | H | cold generate + compile | warm load (cached) | SymPy imported on warm load |")
    echo("|---|---|---|---|---|")
    rows = []
    for scheme in ("central", "accel"):
        for H in horizons:
            with tempfile.TemporaryDirectory() as cache:
                if node:
                    shutil.copytree(node, os.path.join(cache, "builds", os.path.basename(node)))
                # Python's usual bytecode cache (some machines turn it off), as a user's process has it
                env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
                env["TENSORSTEP_CACHE_DIR"] = env["TENSORSTEP_NATIVE_DIR"] = cache
                code = COLD_SNIPPET.format(H=H, kw=repr(SCHEMES[scheme]))
                run = lambda: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                cold = run()
                warms = [run() for _ in range(3)]
                failed = next((r for r in (cold, *warms) if r.returncode), None)
                if failed:
                    echo(f"| {scheme} | {H} | failed: {failed.stderr[-200:]} | | |")
                    continue
                c_s = float(cold.stdout.split()[0])
                w_s = statistics.median(float(w.stdout.split()[0]) for w in warms)
                w_sympy = any(w.stdout.split()[1] == "True" for w in warms)
                rows.append(dict(scheme=scheme, horizon=H, cold=c_s, warm=w_s))
                echo(f"| {scheme} | {H} | {c_s:.2f} s | {w_s * 1e3:.1f} ms | {w_sympy} |")
    return rows


def autograd_floors() -> dict[str, Callable[[], None]]:
    """This machine's fixed cost of one autograd call at B=1, forward+backward, timed with the
    B=1 cases: a trivial 4-output Python autograd.Function, and one built-in op (x * 2)."""

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return tuple(x.new_empty(1, 32, 7) for _ in range(4))

        @staticmethod
        def backward(ctx, *g):
            return torch.empty(1, 31, 7)

    x = torch.randn(1, 31, 7, requires_grad=True)
    g = [torch.ones(1, 32, 7)] * 4
    g1 = [torch.ones(1, 31, 7)]
    return {
        "floor_python_function": lambda: torch.autograd.backward(Trivial.apply(x), g),
        "floor_builtin_op": lambda: torch.autograd.backward([x * 2], g1),
    }
