"""CUDA resource use without a GPU: a module compiled by ``nvcc -cubin -arch=sm_90
--ptxas-options=-v`` and ptxas's report per kernel (registers, spill stores, stack frame, static
shared memory). A module is one library of a spec (codegen/abi.py ``LIBRARIES``), as the runtime
builds them. Used by ``tensorstep bench --cuda-plan`` and tests/cuda/test_ptxas.py.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

ARCH = "sm_90"


def nvcc() -> Optional[str]:
    """The nvcc on PATH, or None."""
    return shutil.which("nvcc")


@dataclasses.dataclass
class Kernel:
    name: str
    registers: int
    spill_stores: int
    stack: int
    shared: int = 0  # static shared memory (bytes)


@dataclasses.dataclass
class Module:
    label: str
    seconds: float
    kernels: list[Kernel]
    error: str = ""


def parse(report: str) -> list[Kernel]:
    """The kernels of a ptxas -v report: name, registers, spill stores, stack frame, shared memory."""
    kernels = []
    for block in re.split(r"ptxas info\s*: Compiling entry function ", report)[1:]:
        name = re.match(r"'(\w+)'", block).group(1)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", block)
        registers = re.search(r"Used (\d+) registers", block)
        smem = re.search(r"(\d+) bytes smem", block)
        kernels.append(Kernel(name, int(registers.group(1)), int(frame.group(2)), int(frame.group(1)),
                              int(smem.group(1)) if smem else 0))
    return kernels


def compile_module(label: str, source: str, workdir: Path, kill_after: float = 600.0) -> Module:
    """nvcc -cubin of one module, timed; killed past ``kill_after`` seconds."""
    src = workdir / f"{label}.cu"
    src.write_text(source)
    cmd = [nvcc() or "nvcc", "-cubin", f"-arch={ARCH}", "--ptxas-options=-v", str(src),
           "-o", str(workdir / f"{label}.cubin")]
    start = time.perf_counter()
    # a session of its own: past the limit, nvcc and the compilers it started are stopped together
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as process:
        try:
            report, _ = process.communicate(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return Module(label, time.perf_counter() - start, [], f"stopped after {kill_after:.0f} s")
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        return Module(label, seconds, [], report[-3000:])
    return Module(label, seconds, parse(report))


def source_of(spec: Any, part: str) -> str:
    """The CUDA source of one library of a spec, as the runtime compiles it."""
    from ..codegen.driver import generate

    return generate(spec, targets=("cuda",), parts=(part,)).source("cuda", part)
