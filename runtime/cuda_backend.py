"""CUDA backend: generated CUDA compiled by NVRTC through CuPy's RawModule.

Launches go on PyTorch's current stream of the tensor's device (no host synchronisation,
safe under CUDA graph capture); outputs come from PyTorch's allocator (runtime.launch).
The generated source is kept in tensorstep's cache, so a warm load needs no code
generation; CuPy's own disk cache then serves the compiled binary.
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import torch

from ..codegen import abi
from .cache import ABI_VERSION, BuildCache, digest
from .fingerprint import generator_fingerprint

THREADS = 256  # a multiple of the warp size (the dt_vjp reduction relies on whole warps)
NVRTC_OPTIONS = ("--std=c++14",)


class CudaUnavailable(RuntimeError):
    """CUDA was asked for but cannot be used here."""


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as err:
        raise CudaUnavailable(
            "device='cuda' needs CuPy: install it with 'pip install tensorstep[cuda]' "
            "(or the cupy-cudaXXx wheel matching your CUDA toolkit)"
        ) from err
    return cupy


def _copy(src: Path, out: Path) -> None:
    shutil.copyfile(src, out)


@functools.lru_cache(maxsize=None)
def cuda_source(spec: Any, part: str) -> str:
    """The CUDA source of one library of a spec, from the cache or freshly generated."""
    def source() -> str:
        from ..codegen.render import render

        return render(spec, "cuda", part)

    env = digest("cuda", ABI_VERSION, generator_fingerprint())[:16]
    _, path = BuildCache().artefact_for(f"{spec.key}-{part}-cuda", env, "cu", source, _copy)
    return path.read_text()


class CudaBackend:
    """The kernels of a spec on one CUDA device."""

    def __init__(self, spec: Any, device: torch.device):
        if not torch.cuda.is_available():
            raise CudaUnavailable("device='cuda' was asked for, but torch.cuda.is_available() is False")
        self.cupy = _cupy()
        self.spec = spec
        self.device = device
        self.functions: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}
        self._bind("core")

    def _bind(self, part: str) -> None:
        cp = self.cupy
        with cp.cuda.Device(self.device.index):
            module = cp.RawModule(code=cuda_source(self.spec, part), options=NVRTC_OPTIONS)
            for kernel in abi.PARTS[part]:
                self.functions[kernel] = module.get_function(abi.symbol(self.spec.name, kernel))

    @functools.cached_property
    def n_coefficients(self) -> int:
        self._bind("dt")
        return _n_coefficients(self.spec)

    def call(self, kernel: str, B: int, args: list[int]) -> None:
        if kernel not in self.functions:
            self._bind("dt")
        columns = 1 if kernel == "dt_vjp_finish" else B * self.spec.dof
        blocks = max(1, (columns + THREADS - 1) // THREADS)
        stream = self._stream(torch.cuda.current_stream(self.device).cuda_stream)
        with self.cupy.cuda.Device(self.device.index), stream:
            self.functions[kernel]((blocks,), (THREADS,), (B, *args))

    def _stream(self, ptr: int) -> Any:
        """PyTorch's current stream seen by CuPy (cached: one wrapper per stream)."""
        if ptr not in self._streams:
            self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr, self.device.index)
        return self._streams[ptr]


def _n_coefficients(spec: Any) -> int:
    """NC_ as written in the generated source (no code generation needed)."""
    source = cuda_source(spec, "dt")
    marker = "NC_ = "
    start = source.index(marker) + len(marker)
    return int(source[start : source.index(" ", start)])
