"""CUDA backend: generated CUDA compiled by NVRTC through CuPy's RawModule.

Launches go on PyTorch's current stream of the tensor's device (no host synchronisation);
outputs come from PyTorch's allocator (runtime.launch). What each call launches, with which grid,
block and temporaries, is the build's launch plan (codegen/targets.py ``CudaLaunchPlan``, rebuilt
from the build's metadata): each call runs the coefficient program once, in a kernel of its own,
into a table the per-element kernels that need it then read; dt gradients are finished by one
small kernel that adds dt_vjp's partial sums in a fixed order and runs the reverse coefficient
program, writing the gradient in dt's dtype. The
temporaries come from PyTorch's caching allocator on
the current stream, which CUDA graph capture supports (the graph keeps them for its replays).
CUDA graph capture is safe once the kernels a capture runs are loaded: a module is never
compiled or loaded inside a capture (the call raises instead); ``Step.prepare`` loads the dt
kernels ahead of one.
The generated source is kept in tensorstep's cache, so a warm load needs no code
generation; CuPy's own disk cache then serves the compiled binary.

A call's host time is mostly Python, so its launches go straight to the driver's
``cuLaunchKernel`` (CuPy's ``cupy.cuda.driver.launchKernel``) with the kernels' function handles
(``RawKernel.kernel.ptr``, loaded for the step's device when a library is bound), their parameters
packed once per (entry point, B) as the driver reads them (``Packed``: every parameter of a CUDA
entry point is 8 bytes, a pointer or an int64_t, which is checked), PyTorch's current stream read
once per call (its raw handle), and CuPy's device switch only where the current device is another.
A call then converts no Python integer per argument, as CuPy's ``RawKernel.__call__`` does. The
launches, grids, blocks, arguments and stream are those of CuPy's call (``TENSORSTEP_CUDA_LAUNCH=cupy``
in the environment, read at load, launches through it instead; so does a CuPy that offers no
function handle or no launchKernel, with a warning).
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..codegen import abi
from ..codegen.arguments import ArgumentTable, table
from ..codegen.targets import CUDA, CUDA_LAUNCHES_KEPT, Launches
from .cache import ABI_VERSION, Build, BuildCache, building, digest, slow_notice
from .fingerprint import generator_fingerprint
from .launch import DTYPES, capturing, warm_up_first

#: One launch bound to a call: (kernel, grid, block, shared memory bytes, arguments after B)
Bound = tuple[str, int, int, int, tuple[int, ...]]


def check_arguments(launches: Launches, args: Sequence[int]) -> None:
    """A call passes one value for each argument of its entry point after B."""
    if len(args) != len(launches.parameters):
        raise ValueError(f"expected {len(launches.parameters)} arguments ({', '.join(launches.parameters)}), "
                         f"got {len(args)}")


def bind(launches: Launches, args: Sequence[int],
         empty: Callable[[int, torch.dtype], torch.Tensor]) -> tuple[list[Bound], list[torch.Tensor]]:
    """A plan's launches for one call of an entry point of the C ABI (``args`` in its order, after
    B: ``launches.parameters``), with their temporaries from ``empty(size, dtype)``; the caller
    keeps the buffers until the launches are queued. Which value goes where is worked out once
    per launches (``Launches.binding``); a call only picks its values."""
    check_arguments(launches, args)
    bound, constants = launches.binding
    buffers = [empty(t.size, DTYPES[t.dtype]) for t in launches.temporaries]
    values = [*args, *(buffer.data_ptr() for buffer in buffers), *constants]
    return [(kernel, grid, block, shared, pick(values)) for kernel, grid, block, shared, pick in bound], buffers


#: the bytes of every parameter of a CUDA entry point (a pointer or an int64_t), as packed for the driver
SLOT = 8


def packable(kernel: str, table: ArgumentTable) -> bool:
    """Every parameter of a CUDA entry point is a pointer or an int64_t (8 bytes, ``SLOT``)."""
    return all("*" in t or t == "int64_t" for t, _ in abi.cuda_arguments(kernel, table))


class Packed:
    """The launches of one entry point over a batch of B (``Launches``) with their parameters as
    ``cuLaunchKernel`` reads them: an array of 8-byte slots (B, the call's arguments, its
    temporaries' addresses, the plan's integers) and, for each launch, its array of pointers to
    its parameters' slots, in the order of the kernel's C signature (B, then the launch's arguments,
    ``Launches.positions``). A call fills the slots of its arguments and temporaries and launches;
    the lock keeps two threads from filling the slots of one object at once (the driver copies
    the parameters when it queues a launch)."""

    def __init__(self, launches: Launches, B: int, handles: dict[str, int]):
        placed, constants = launches.positions
        self.launches = launches
        self.arguments = len(launches.parameters)
        self.slots = (ctypes.c_int64 * (1 + self.arguments + len(launches.temporaries) + len(constants)))()
        self.slots[0] = B
        first = 1 + self.arguments + len(launches.temporaries)
        self.slots[first:] = list(constants)
        base = ctypes.addressof(self.slots)
        self._pointers = []  # kept: the driver reads them
        #: (function handle, grid, block, shared memory bytes, address of the parameters' pointer array)
        self.runs: list[tuple[int, int, int, int, int]] = []
        for kernel, grid, block, shared, positions in placed:
            pointers = (ctypes.c_void_p * (1 + len(positions)))(base, *(base + SLOT * (1 + p) for p in positions))
            self._pointers.append(pointers)
            self.runs.append((handles[kernel], grid, block, shared, ctypes.addressof(pointers)))
        self.lock = threading.Lock()

    def launch(self, launch_kernel: Callable[..., Any], stream: int, args: Sequence[int],
               buffers: Sequence[torch.Tensor]) -> None:
        """Queue the launches on ``stream`` (``launch_kernel``: the driver's cuLaunchKernel)."""
        n = self.arguments
        with self.lock:
            slots = self.slots
            slots[1:n + 1] = args
            for j, buffer in enumerate(buffers, n + 1):
                slots[j] = buffer.data_ptr()
            for handle, grid, block, shared, params in self.runs:
                launch_kernel(handle, grid, 1, 1, block, 1, 1, shared, stream, params, 0)


def raw_stream_reader() -> Callable[[int], int]:
    """The raw handle of PyTorch's current stream on a device (by index): PyTorch's own accessor
    where it has it (``torch._C._cuda_getCurrentRawStream``, what compiled code calls), else
    ``torch.cuda.current_stream``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


#: ``TENSORSTEP_CUDA_LAUNCH=cupy``: launch through CuPy's RawKernel call (read when a step is loaded)
LAUNCH_SWITCH = "TENSORSTEP_CUDA_LAUNCH"


NVRTC_OPTIONS = ("--std=c++14",)


class CudaUnavailable(RuntimeError):
    """CUDA was asked for but cannot be used here."""


def install_hint(torch_cuda: Any) -> str:
    """The install command for the CuPy that matches a PyTorch build's CUDA version."""
    major = str(torch_cuda or "12").split(".")[0]
    if major in ("12", "13"):
        return f"pip install 'tensorstep[cuda{major}]' (CuPy for CUDA {major}: cupy-cuda{major}x)"
    return f"pip install cupy-cuda{major}x"


def check_versions(torch_cuda: Any, cupy_runtime: int, nvrtc: Any) -> None:
    """CuPy's CUDA runtime and NVRTC must be of the CUDA major version PyTorch was built with
    (a CUDA 13 PyTorch brings NVRTC 13 only; cupy-cuda12x needs NVRTC 12). ``cupy_runtime`` is
    CuPy's runtime version number (12080 for 12.8), ``nvrtc`` NVRTC's (major, minor) or an
    exception from loading it."""
    want = str(torch_cuda).split(".")[0] if torch_cuda else None
    have = str(cupy_runtime // 1000)
    if want is not None and have != want:
        raise CudaUnavailable(
            f"CuPy is built for CUDA {have}, but PyTorch for CUDA {torch_cuda} (torch.version.cuda): "
            f"install the matching CuPy, {install_hint(torch_cuda)}, and uninstall cupy-cuda{have}x")
    if isinstance(nvrtc, BaseException):
        raise CudaUnavailable(
            f"CuPy cannot load NVRTC {have} ({nvrtc}), which compiles tensorstep's kernels: install it with "
            f"'pip install \"cupy-cuda{have}x[ctk]>=14\"' (NVRTC as a wheel) or a CUDA {have} toolkit")
    if want is not None and str(nvrtc[0]) != want:
        raise CudaUnavailable(
            f"NVRTC {nvrtc[0]}.{nvrtc[1]} was found, but PyTorch is built for CUDA {torch_cuda}: "
            f"{install_hint(torch_cuda)}")


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as err:
        raise CudaUnavailable(
            f"device='cuda' needs CuPy: install it with {install_hint(torch.version.cuda)}") from err
    try:
        nvrtc: Any = cupy.cuda.nvrtc.getVersion()
    except Exception as err:  # the shared library is missing or of another major version
        nvrtc = err
    check_versions(torch.version.cuda, cupy.cuda.runtime.runtimeGetVersion(), nvrtc)
    return cupy


def _copy(src: Path, out: Path) -> None:
    shutil.copyfile(src, out)


@functools.lru_cache(maxsize=32)
def cuda_source(spec: Any, part: str) -> tuple[str, dict]:
    """The CUDA source of one library of a spec and its build metadata, from the cache or
    freshly generated (codegen's driver); the last few kept in memory (a source can be megabytes; the
    others are read from the cache again). Generating it is a build of the wait the load's notice
    is about (``cache.building``, as NVRTC's build that follows), its imports (SymPy, Jinja2) included."""
    def generate() -> tuple[str, dict]:
        with building(spec.name, f"the CUDA source of its {part} kernels", spec.horizon):
            from ..codegen.driver import generate

            generated = generate(spec, targets=("cuda",), parts=(part,))
            return generated.source("cuda", part), dict(generated.metadata)

    env = digest("cuda", ABI_VERSION, generator_fingerprint())[:16]
    _, path, metadata = BuildCache().artefact_for(f"{spec.key}-{part}-cuda", env, "cu", generate, _copy)
    return path.read_text(), metadata


#: a fused B-spline step with fewer than degree + 4 knots: its CUDA build still running after this many
#: seconds says why it may take minutes (``build_notices``): too few of its knot spans repeat for a loop,
#: so its forward and adjoint are one straight-line column each, and NVRTC's time on such columns grows
#: about as the square of the horizon (BENCHMARKS.md, issue 42, "nvcc's time on long fused columns").
#: The other fused steps' columns loop over their steps or knot spans (codegen/fused.py
#: ``forward_rolled``, ``adjoint_rolled``, ``rolled_adjoint``) and compile in about the same time at
#: any horizon: no such notice
LONG_FUSED_BUILD_S = 30.0


def build_notices(spec: Any, args: ArgumentTable, part: str) -> list[Union[Build, threading.Timer]]:
    """Started notices of a module's build (CuPy's disk cache serves a built one at once, and they are
    cancelled unprinted): what is compiled, once the wait passes ``cache.SLOW_BUILD_S`` (``building``);
    for a fused B-spline step's core module with few knots, after ``LONG_FUSED_BUILD_S``, why it takes long and that it ends."""
    notices: list[Union[Build, threading.Timer]] = [building(spec.name, f"CUDA {part} kernels with NVRTC",
                                                             spec.horizon)]
    straight = getattr(spec, "control", "") == "bspline" and spec.knots < spec.degree + 4
    if args.fused and part == "core" and straight:
        notices.append(slow_notice(
            f"still compiling {spec.name}: a fused B-spline step's CUDA forward and adjoint are one "
            f"straight-line column each, whose compile time grows about with the square of the horizon "
            f"(H={spec.horizon}, {spec.dtype}): at H of 150 and more it can take minutes. It ends; CuPy's "
            "disk cache keeps the kernels for later loads", after=LONG_FUSED_BUILD_S))
    return notices


def entry_points(args: ArgumentTable, part: str, metadata: dict) -> tuple[str, ...]:
    """The kernels a library's source defines, which the backend binds by name (the coefficient
    form the source was generated with is in its metadata)."""
    return CUDA.entry_points(abi.part_kernels(part, args), args, str(metadata["coefficients"]))


#: the temporaries' dtypes as the native node reads them (``CudaBackend.native_plan``): their codes
TEMPORARY_DTYPES = ("float32", "float64")


class CudaBackend:
    """The kernels of a spec on one CUDA device."""

    #: the native node's launch and stream functions (runtime/native_node.cpp, as addresses): 0 for the
    #: driver's cuLaunchKernel and PyTorch's current stream (a test double gives its own)
    native_launch = (0, 0)
    #: the native node's handle of these kernels (runtime/native.py), once registered
    native_handle: Optional[int] = None

    def __init__(self, spec: Any, device: torch.device):
        if not torch.cuda.is_available():
            raise CudaUnavailable("device='cuda' was asked for, but torch.cuda.is_available() is False")
        self.cupy = _cupy()
        self.spec = spec
        self.device = device
        self.index = device.index
        self.table = table(spec)
        self.functions: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}
        #: the kernels' function handles on this device (direct launches)
        self.handles: dict[str, int] = {}
        self._packed: dict[tuple[str, int], Packed] = {}
        self._raw_stream = raw_stream_reader()
        self._launch_kernel = getattr(getattr(self.cupy.cuda, "driver", None), "launchKernel", None)
        self._get_device = self.cupy.cuda.runtime.getDevice
        self._contexts = threading.local()
        #: launches go to the driver directly (``Packed``), else through CuPy's RawKernel call
        self.direct = os.environ.get(LAUNCH_SWITCH) != "cupy"
        if self.direct and self._launch_kernel is None:
            self._no_direct("this CuPy has no cupy.cuda.driver.launchKernel")
        self.metadata = self._bind("core")
        self.plan = CUDA.launch_plan(spec, self.metadata)  # every library's metadata is the same

    def _no_direct(self, why: str) -> None:
        warnings.warn(f"tensorstep: CUDA kernels launch through CuPy's RawKernel call, whose host time per "
                      f"launch is larger: {why}", RuntimeWarning, stacklevel=3)
        self.direct = False

    def _bind(self, part: str) -> dict:
        if capturing():
            raise warm_up_first(f"the {abi.LIBRARY_ROLES.get(part, part)} kernels ({part}) would be compiled and loaded")
        cp = self.cupy
        source, metadata = cuda_source(self.spec, part)
        notices = build_notices(self.spec, self.table, part)
        try:
            with cp.cuda.Device(self.device.index):
                module = cp.RawModule(code=source, options=NVRTC_OPTIONS)
                for kernel in entry_points(self.table, part, metadata):
                    function = module.get_function(abi.symbol(self.spec.name, kernel))
                    self.functions[kernel] = function
                    if self.direct:
                        if not packable(kernel, self.table):
                            self._no_direct(f"the kernel {kernel} has a parameter of another size than {SLOT} bytes")
                        else:
                            try:  # the kernel for this device (CuPy compiles and loads the module here)
                                self.handles[kernel] = int(function.kernel.ptr)
                            except AttributeError:
                                self._no_direct("this CuPy's RawKernel offers no function handle (kernel.ptr)")
        finally:
            for notice in notices:
                notice.cancel()
        self._contexts.__dict__[self.index] = True  # loading the module made the device's context current here
        return metadata

    def load_part(self, part: str) -> None:
        """Load a library's kernels unless they are loaded."""
        if not all(k in self.functions for k in entry_points(self.table, part, self.metadata)):
            self._bind(part)

    def empty(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for one call, from PyTorch's caching allocator (on the current stream)."""
        return torch.empty(size, dtype=dtype, device=self.device)

    def call(self, kernel: str, B: int, args: list[int]) -> None:
        if kernel not in self.functions:
            self.load_part(abi.library(kernel))
        launches = self.plan.launches(kernel, B)
        if not self.direct:
            return self._call_cupy(launches, B, args)
        check_arguments(launches, args)
        packed = self._packed.get((kernel, B))
        if packed is None or packed.launches is not launches:
            packed = self._pack(kernel, B, launches)
        buffers = [self.empty(t.size, DTYPES[t.dtype]) for t in launches.temporaries]
        stream = self._raw_stream(self.index)
        if self._get_device() == self.index:
            self._launch(packed, stream, args, buffers)
        else:
            with self.cupy.cuda.Device(self.index):
                self._launch(packed, stream, args, buffers)
        del buffers  # queued: the caching allocator reuses them in stream order

    def native_plan(self, kernel: str, B: int) -> list[int]:
        """What the native node launches for an entry point over a batch of B, as ``Packed`` launches
        it, flattened into integers (runtime/native_node.cpp ``read_plan``): the number of arguments
        after B; the temporaries (count, then each one's elements and dtype code, ``TEMPORARY_DTYPES``);
        the plan's integers (count, then each); the launches (count, then each one's function handle,
        grid, block, shared memory bytes, and its parameters' positions after B: count, then each)."""
        if kernel not in self.functions:
            self.load_part(abi.library(kernel))
        launches = self.plan.launches(kernel, B)
        placed, constants = launches.positions
        rows = [len(launches.parameters), len(launches.temporaries)]
        for t in launches.temporaries:
            rows += [t.size, TEMPORARY_DTYPES.index(t.dtype)]
        rows += [len(constants), *constants, len(placed)]
        for name, grid, block, shared, positions in placed:
            rows += [self.handles[name], grid, block, shared, len(positions), *positions]
        return rows

    def _pack(self, kernel: str, B: int, launches: Launches) -> Packed:
        packed = self._packed[(kernel, B)] = Packed(launches, B, self.handles)
        if len(self._packed) > CUDA_LAUNCHES_KEPT:
            self._packed.pop(next(iter(self._packed)), None)  # the oldest
        return packed

    def _launch(self, packed: Packed, stream: int, args: Sequence[int], buffers: list[torch.Tensor]) -> None:
        """The launches on the current device, whose context is made current on this thread first
        (as CuPy's launches do: a runtime call, once per thread and device; not on the thread that
        loaded the kernels, where loading them did)."""
        ready = self._contexts.__dict__
        if self.index not in ready:
            self.cupy.cuda.runtime.memGetInfo()
            ready[self.index] = True
        packed.launch(self._launch_kernel, stream, args, buffers)

    def _call_cupy(self, launches: Launches, B: int, args: list[int]) -> None:
        """The launches through CuPy's RawKernel call, in CuPy's device and stream contexts."""
        bound, buffers = bind(launches, args, self.empty)
        stream = self._stream(self._raw_stream(self.index))
        with self.cupy.cuda.Device(self.device.index), stream:
            for name, grid, block, shared, arguments in bound:
                self.functions[name]((grid,), (block,), (B, *arguments), shared_mem=shared)
        del buffers  # queued: the caching allocator reuses them in stream order

    def _stream(self, ptr: int) -> Any:
        """PyTorch's current stream seen by CuPy (cached: one wrapper per stream)."""
        if ptr not in self._streams:
            self._streams[ptr] = external_stream(self.cupy, ptr, self.device.index)
        return self._streams[ptr]


class _StreamHandle:
    """A raw CUDA stream handle offered through the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(cupy: Any, ptr: int, device_index: int) -> Any:
    """CuPy's view of a stream it did not create: ``Stream.from_external`` where CuPy has it (CuPy 14
    deprecates ``ExternalStream``), else ``ExternalStream``."""
    from_external = getattr(getattr(cupy.cuda, "Stream", None), "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(ptr, device_index)
    with cupy.cuda.Device(device_index):
        return from_external(_StreamHandle(ptr))
