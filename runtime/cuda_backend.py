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
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..codegen import abi
from ..codegen.arguments import ArgumentTable, table
from ..codegen.targets import CUDA, Launches
from .cache import ABI_VERSION, BuildCache, digest
from .fingerprint import generator_fingerprint
from .launch import DTYPES, capturing, warm_up_first

#: One launch bound to a call: (kernel, grid, block, shared memory bytes, arguments after B)
Bound = tuple[str, int, int, int, tuple[int, ...]]


def bind(launches: Launches, args: Sequence[int],
         empty: Callable[[int, torch.dtype], torch.Tensor]) -> tuple[list[Bound], list[torch.Tensor]]:
    """A plan's launches for one call of an entry point of the C ABI (``args`` in its order, after
    B: ``launches.parameters``), with their temporaries from ``empty(size, dtype)``; the caller
    keeps the buffers until the launches are queued. Which value goes where is worked out once
    per launches (``Launches.binding``); a call only picks its values."""
    if len(args) != len(launches.parameters):
        raise ValueError(f"expected {len(launches.parameters)} arguments ({', '.join(launches.parameters)}), "
                         f"got {len(args)}")
    bound, constants = launches.binding
    buffers = [empty(t.size, DTYPES[t.dtype]) for t in launches.temporaries]
    values = [*args, *(buffer.data_ptr() for buffer in buffers), *constants]
    return [(kernel, grid, block, shared, pick(values)) for kernel, grid, block, shared, pick in bound], buffers


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


@functools.lru_cache(maxsize=None)
def cuda_source(spec: Any, part: str) -> tuple[str, dict]:
    """The CUDA source of one library of a spec and its build metadata, from the cache or
    freshly generated (codegen's driver)."""
    def generate() -> tuple[str, dict]:
        from ..codegen.driver import generate

        generated = generate(spec, targets=("cuda",), parts=(part,))
        return generated.source("cuda", part), dict(generated.metadata)

    env = digest("cuda", ABI_VERSION, generator_fingerprint())[:16]
    _, path, metadata = BuildCache().artefact_for(f"{spec.key}-{part}-cuda", env, "cu", generate, _copy)
    return path.read_text(), metadata


def entry_points(args: ArgumentTable, part: str, metadata: dict) -> tuple[str, ...]:
    """The kernels a library's source defines, which the backend binds by name (the coefficient
    form the source was generated with is in its metadata)."""
    return CUDA.entry_points(abi.part_kernels(part, args), args, str(metadata["coefficients"]))


class CudaBackend:
    """The kernels of a spec on one CUDA device."""

    def __init__(self, spec: Any, device: torch.device):
        if not torch.cuda.is_available():
            raise CudaUnavailable("device='cuda' was asked for, but torch.cuda.is_available() is False")
        self.cupy = _cupy()
        self.spec = spec
        self.device = device
        self.table = table(spec)
        self.functions: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}
        self.metadata = self._bind("core")
        self.plan = CUDA.launch_plan(spec, self.metadata)  # every library's metadata is the same

    def _bind(self, part: str) -> dict:
        if capturing():
            raise warm_up_first(f"the {abi.LIBRARY_ROLES.get(part, part)} kernels ({part}) would be compiled and loaded")
        cp = self.cupy
        source, metadata = cuda_source(self.spec, part)
        with cp.cuda.Device(self.device.index):
            module = cp.RawModule(code=source, options=NVRTC_OPTIONS)
            for kernel in entry_points(self.table, part, metadata):
                self.functions[kernel] = module.get_function(abi.symbol(self.spec.name, kernel))
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
        launches, buffers = bind(self.plan.launches(kernel, B), args, self.empty)
        stream = self._stream(torch.cuda.current_stream(self.device).cuda_stream)
        with self.cupy.cuda.Device(self.device.index), stream:
            for name, grid, block, shared, arguments in launches:
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
