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


def launch_columns(spec: Any, kernel: str, B: int) -> int:
    """Threads a kernel needs: one per (batch, dof) column; dt_vjp_finish one in all, or one per
    trajectory with dt="per_trajectory"."""
    if kernel == "dt_vjp_finish":
        return B if getattr(spec, "dt", "") == "per_trajectory" else 1
    return B * spec.dof


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
        self.metadata = self._bind("core")

    def _bind(self, part: str) -> dict:
        cp = self.cupy
        source, metadata = cuda_source(self.spec, part)
        with cp.cuda.Device(self.device.index):
            module = cp.RawModule(code=source, options=NVRTC_OPTIONS)
            for kernel in abi.PARTS[part]:
                self.functions[kernel] = module.get_function(abi.symbol(self.spec.name, kernel))
        return metadata

    def call(self, kernel: str, B: int, args: list[int]) -> None:
        if kernel not in self.functions:
            self._bind("dt")
        columns = launch_columns(self.spec, kernel, B)
        blocks = max(1, (columns + THREADS - 1) // THREADS)
        stream = self._stream(torch.cuda.current_stream(self.device).cuda_stream)
        with self.cupy.cuda.Device(self.device.index), stream:
            self.functions[kernel]((blocks,), (THREADS,), (B, *args))

    def _stream(self, ptr: int) -> Any:
        """PyTorch's current stream seen by CuPy (cached: one wrapper per stream)."""
        if ptr not in self._streams:
            self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr, self.device.index)
        return self._streams[ptr]
