"""Host time of a CUDA step's call, by launch path (``python -m tensorstep.bench.cuda_host``).

The costs bench's case (bench/costs.py: B=400, float32, H=32, D=7; fused: the seven terms, outputs
P; held: the same with the cost parameters held by the step, ``set_costs``; plain: the step alone,
gradient on P only), forward+backward, on three paths: the native node launching the kernels itself
("native", runtime/native_node.cpp, a CUDA step's default), and the Python path (``TENSORSTEP_CUDA_NATIVE=0``)
with its launches going straight to the driver ("direct", runtime/cuda_backend.py ``Packed``) or
through CuPy's RawKernel call ("cupy", what ``TENSORSTEP_CUDA_LAUNCH=cupy`` selects), the (method,
path) pairs taking turns in every round (a throughput loop of ``--calls`` calls after warm-up,
synchronised, per call; the median over ``--rounds``; ``--methods`` picks some of the methods).
First the three paths' outputs and gradients are compared bit for bit (the same launches: they
must be equal).

``--stub``: no GPU needed: the same calls on the CPU, every launch stubbed out (a stand-in CuPy
whose launches do nothing, PyTorch's stream read stubbed; the native node's launch and stream
functions C functions that do nothing), so only the host's work is timed; the CuPy call's own
conversion of each argument is not in these figures.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import statistics
import time
import types
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from .costs import TERMS, CostCase, _inputs, parameters
from .harness import DT


class _StubCupy:
    """Just what CudaBackend calls of CuPy, each launch doing nothing."""

    def __init__(self) -> None:
        class Kernel:
            kernel = types.SimpleNamespace(ptr=1)

            def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
                pass

        class Module:
            def __init__(self, code: str, options: tuple):
                pass

            def get_function(self, symbol: str) -> Kernel:
                return Kernel()

        self.RawModule = Module
        self.cuda = types.SimpleNamespace(
            Device=lambda index: contextlib.nullcontext(),
            ExternalStream=lambda ptr, index: contextlib.nullcontext(),
            driver=types.SimpleNamespace(launchKernel=lambda *args: None),
            runtime=types.SimpleNamespace(getDevice=lambda: 0, memGetInfo=lambda: None))


@contextlib.contextmanager
def _stubbed() -> Iterator[None]:
    """CUDA as the CPU build of PyTorch does not have it: available, never capturing, one stream."""
    from ..runtime import cuda_backend

    stream = types.SimpleNamespace(cuda_stream=0)
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: stream), \
            mock.patch.object(cuda_backend, "raw_stream_reader", lambda: lambda index: stream.cuda_stream), \
            mock.patch.object(cuda_backend, "_cupy", _StubCupy):
        yield


#: a launch (cuLaunchKernel's signature) and a stream function that do nothing, for the native node
_STUB_FUNCTIONS = """int ts_stub_launch(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void* stream, void** params, void** extra) { return 0; }
long long ts_stub_stream(long long device) { return 0; }
"""


@functools.lru_cache(maxsize=None)
def _stub_functions() -> tuple[ctypes.CDLL, tuple[int, int]]:
    """The stub functions built by the C backend's compiler (cached by content): (library, addresses)."""
    from ..runtime import cbackend
    from ..runtime.cache import BuildCache, digest

    path = BuildCache().build(digest(_STUB_FUNCTIONS, cbackend.environment_key()), "so", _STUB_FUNCTIONS,
                              cbackend._compile, {})
    lib = ctypes.CDLL(str(path))
    return lib, tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (lib.ts_stub_launch, lib.ts_stub_stream))


def _native_switch(on: bool = True) -> Any:
    """CUDA steps loaded inside take the native node (``on``) or the Python path (``TENSORSTEP_CUDA_NATIVE``)."""
    from ..runtime.native import CUDA_SWITCH

    return mock.patch.dict(os.environ, {CUDA_SWITCH: "1" if on else "0"})


def _stub_step(spec: Any, native: bool = False) -> Any:
    """A step on the CPU whose kernels are a CudaBackend on ``_StubCupy`` (the Python path, as on CUDA;
    with ``native``, the native node's launches, through ``_stub_functions``)."""
    from ..runtime import native as node
    from ..runtime.api import Step
    from ..runtime.cuda_backend import CudaBackend
    from ..runtime.launch import Launcher

    backend = CudaBackend(spec, torch.device("cuda", 0))
    backend.device = torch.device("cpu")
    backend.empty = lambda size, dtype: torch.empty(size, dtype=dtype)
    if native:
        backend.native_launch = _stub_functions()[1]
        node.wait()
        with _native_switch():
            step = Step(spec, torch.device("cpu"), Launcher(spec, backend))
        if step.native is None:
            raise SystemExit("the native autograd node is unavailable here (no C++ compiler?)")
        return step
    with mock.patch.object(Step, "_take_native", lambda self: None):
        step = Step(spec, torch.device("cpu"), Launcher(spec, backend))
    step.native, step._native_pending = None, False
    return step


def _load(spec: Any, device: torch.device, native: bool) -> Any:
    """A CUDA step on the native node (``native``, waiting for its build) or on the Python path."""
    import tensorstep as ts
    from ..runtime import native as node

    if native:
        node.wait()
    with _native_switch(native):
        step = ts.load(spec, device)
    if native and step.native is None:
        raise SystemExit("the native autograd node is unavailable here (no C++ compiler?)")
    return step


def callables(case: CostCase, stub: bool, native: bool = False) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """(each method's forward+backward as a no-argument callable, each method's step); ``native``:
    steps on the native node (else the Python path)."""
    dev = torch.device(case.device)
    gen, u, starts = _inputs(case)
    u.requires_grad_(True)
    params = parameters(case, gen)
    W = torch.randn(case.batch, case.horizon, case.dof, generator=gen, dtype=case.torch_dtype).to(dev)
    ones = torch.ones(case.batch, len(TERMS), dtype=case.torch_dtype, device=dev)
    if stub:
        load = functools.partial(_stub_step, native=native)
    else:
        load = functools.partial(_load, device=dev, native=native)
    fused, held, plain = load(case.fused), load(case.fused), load(case.plain)
    held.set_costs(**params)

    def fused_call() -> tuple:
        u.grad = None
        outs = fused(u, *starts, DT, **params)
        torch.autograd.backward(outs, (W, ones))
        return (*outs, u.grad)

    def held_call() -> tuple:
        u.grad = None
        outs = held(u, *starts, DT)
        torch.autograd.backward(outs, (W, ones))
        return (*outs, u.grad)

    def plain_call() -> tuple:
        u.grad = None
        P = plain(u, *starts, DT)[0]
        torch.autograd.backward((P,), (W,))
        return (P, u.grad)

    return ({"fused": fused_call, "held": held_call, "plain": plain_call},
            {"fused": fused, "held": held, "plain": plain})


def _cupy_version() -> str:
    import cupy

    return str(cupy.__version__)


#: the launch paths, in the order they are printed
PATHS = ("native", "direct", "cupy")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=400)
    parser.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stub", action="store_true", help="no GPU: launches stubbed out, the CPU's host work")
    parser.add_argument("--methods", default="fused,held,plain", help="comma-separated, of fused, held, plain")
    args = parser.parse_args(argv)
    stub = args.stub or not torch.cuda.is_available()
    case = CostCase(batch=args.batch, device="cpu" if stub else "cuda")
    context = _stubbed() if stub else contextlib.nullcontext()
    sync = torch.cuda.synchronize if not stub else (lambda: None)
    with context:
        methods, steps = callables(case, stub)
        native_methods, _ = callables(case, stub, native=True)

        def use(method: str, path: str) -> Callable[[], Any]:
            if path == "native":
                return native_methods[method]
            backend = steps[method].launcher.backend
            if path == "direct" and not backend.handles:
                raise SystemExit("no direct launches here: CuPy offers no function handles or no launchKernel "
                                 "(see the warning above)")
            backend.direct = path == "direct"
            return methods[method]

        if not stub:
            for method in methods:
                got = [[t.detach().clone() for t in use(method, path)()] for path in PATHS]
                same = all(torch.equal(a, b) for other in got[1:] for a, b in zip(got[0], other))
                print(f"{method}: native, direct and cupy launches give the same outputs and gradients bit for bit: "
                      f"{same}")
                if not same:
                    raise SystemExit(f"{method}: the launch paths disagree")
        chosen = [m for m in args.methods.split(",") if m in methods]
        pairs = [(m, p) for m in chosen for p in PATHS]
        times: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
        for p in pairs:  # warm-up
            fn = use(*p)
            for _ in range(30):
                fn()
        sync()
        for _ in range(args.rounds):
            for p in pairs:
                fn = use(*p)
                fn()
                sync()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                sync()
                times[p].append((time.perf_counter() - start) / args.calls * 1e6)
    where = "CPU, launches stubbed" if stub else f"{torch.cuda.get_device_name()}, CuPy {_cupy_version()}"
    print(f"B={args.batch} float32 H=32 D=7, {where}, torch {torch.__version__}: forward+backward, µs per call "
          f"(median of {args.rounds} rounds of {args.calls} calls; range)")
    for method in chosen:
        median = {p: statistics.median(times[(method, p)]) for p in PATHS}
        ranges = "   ".join(f"{p} {min(times[(method, p)]):.1f}-{max(times[(method, p)]):.1f}" for p in PATHS)
        print(f"  {method + ':':6} native {median['native']:7.1f}   direct {median['direct']:7.1f}   "
              f"cupy {median['cupy']:7.1f}   direct / native {median['direct'] / median['native']:.2f}   "
              f"cupy / direct {median['cupy'] / median['direct']:.2f}   ({ranges})")


if __name__ == "__main__":
    main()
