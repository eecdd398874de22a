"""The native autograd node (runtime/native_node.cpp): build once per PyTorch install, load, route.

Python's autograd.Function adds tens of microseconds per call, more than the kernels cost at
small batches. The native node is one generic C++ autograd Function that calls the generated
kernels by address, with each spec's argument table registered alongside (its checks, pointer
lists and shapes follow the table). It is compiled against the installed PyTorch's headers
(once per PyTorch install and compiler, kept in the kernel cache) and used for plain CPU calls:
gradients to the tensor inputs. dt gradients, forward mode, functorch transforms and
torch.compile keep the Python Functions. ``TENSORSTEP_NATIVE=0`` turns it off; when it
cannot be built (no C++ compiler, no PyTorch headers) steps run on the Python path with one
warning.
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from ..codegen.arguments import ABSENT, INDEX, KERNEL, MESSAGES, OPTIONAL, REQUIRED, STEP, ArgumentTable
from .cache import ABI_VERSION, BuildCache, CacheError, digest

SOURCE = Path(__file__).with_name("native_node.cpp")
CXX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")


def enabled() -> bool:
    """False when TENSORSTEP_NATIVE is 0/false/off/no."""
    return os.environ.get("TENSORSTEP_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def _torch_paths() -> tuple[Path, list[Path]]:
    root = Path(torch.__file__).resolve().parent
    return root / "lib", [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]


def _cxx() -> Optional[str]:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((p for p in map(shutil.which, candidates) if p), None)


def _command(cxx: str, src: Path, out: Path) -> list[str]:
    lib, includes = _torch_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes), "-x", "c++",
            str(src), "-o", str(out), f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10"]


def _compile(cxx: str, src: Path, out: Path) -> None:
    print(f"tensorstep: building the native autograd node for torch {torch.__version__} "
          "(once per PyTorch install, about 20 s)...", file=sys.stderr, flush=True)
    result = subprocess.run(_command(cxx, src, out), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"C++ compilation failed:\n{result.stderr[-3000:]}")


def build_key(cxx: str, source: str) -> str:
    """Content hash of the node's build: source, compiler, flags, PyTorch version and location."""
    st = os.stat(os.path.realpath(cxx))
    return digest(source, os.path.realpath(cxx), str(st.st_mtime_ns), str(st.st_size), " ".join(CXX_FLAGS),
                  torch.__version__, str(_torch_paths()[0]), ABI_VERSION, platform.machine())


_LOCK = threading.Lock()


def library() -> Optional[Path]:
    """The built node (from the cache, else built now); None when off or impossible (warned).
    Decided once per process (the node registers ops, which cannot happen twice)."""
    with _LOCK:
        return _library()


@functools.lru_cache(maxsize=1)
def _library() -> Optional[Path]:
    if not enabled() or platform.system() == "Windows":
        return None
    cxx = _cxx()
    _, includes = _torch_paths()
    if cxx is None or not (includes[0] / "torch" / "library.h").exists():
        warnings.warn("tensorstep: no C++ compiler or PyTorch headers, so the native autograd node is not built; "
                      "steps use the Python autograd path (correct, more overhead per call). Install g++ to enable it.",
                      stacklevel=3)
        return None
    try:
        source = SOURCE.read_text()
        path = BuildCache().build(build_key(cxx, source), "native.so", source, functools.partial(_compile, cxx))
        torch.ops.load_library(str(path))
    except (CacheError, RuntimeError, OSError) as err:
        warnings.warn(f"tensorstep: the native autograd node could not be built or loaded ({err}); "
                      "steps use the Python autograd path", stacklevel=3)
        return None
    _register_python_parts()
    return path


_PYTHON_IMPL: Optional[torch.library.Library] = None
_LAUNCHERS: dict[int, Any] = {}
_HANDLES: dict[tuple[int, int], int] = {}  # kernel addresses → handle: loading a spec again reuses it


def _register_python_parts() -> None:
    """The create_graph adjoint, in Python: AdjointFunction is differentiable (backward, jvp, vmap)."""
    from .autograd import AdjointFunction

    def adjoint_graph(handle: int, grads: list, dt: torch.Tensor, batch: int) -> list[torch.Tensor]:
        return list(AdjointFunction.apply(_LAUNCHERS[handle], dt, batch, *grads))

    global _PYTHON_IMPL
    _PYTHON_IMPL = torch.library.Library("tensorstep_native", "IMPL")  # kept alive: it holds the registration
    _PYTHON_IMPL.impl("adjoint_graph", adjoint_graph, "CompositeImplicitAutograd")


def handle(launcher: Any) -> Optional[int]:
    """Register a CPU launcher's kernels with the node; None when the node is unavailable."""
    if library() is None:
        return None
    with _LOCK:
        return _handle(launcher)


#: the free shape symbols, in the order of the node's negative size codes (-1 is B, -2 S, ...)
SYMBOLS = ("B", "S", "G")
#: message templates, in the order of the node's Message enum
MESSAGE_KEYS = ("missing", "unexpected", "layout", "dims", "shape", "dtype", "index_dtype", "device", "empty",
                "no_rows")
RULES = {KERNEL: 0, INDEX: 1, STEP: 2}
PRESENCES = {REQUIRED: 0, OPTIONAL: 1, ABSENT: 2}


def _codes(shape: tuple) -> list[int]:
    """A table shape (sizes and free symbols) as the node's size codes."""
    return [s if isinstance(s, int) else -1 - SYMBOLS.index(s) for s in shape]


def table_rows(table: ArgumentTable) -> dict[str, Any]:
    """The argument table as the node's registration arguments (one list per column)."""
    position = {a.name: i for i, a in enumerate(table.inputs)}
    shapes = [_codes(table.symbolic(a)) for a in table.inputs]
    return dict(
        names=[a.name for a in table.inputs], meanings=[a.meaning for a in table.inputs],
        ranks=[len(s) for s in shapes], shapes=[c for s in shapes for c in s],
        rules=[RULES[a.dtype] for a in table.inputs], presences=[PRESENCES[a.presence] for a in table.inputs],
        indices=[position[a.index] if a.index else -1 for a in table.inputs],
        differentiable=[int(a.differentiable) for a in table.inputs],
        output_shape=_codes(table.symbolic(table.outputs[0])), outputs=len(table.outputs),
        symbols=list(SYMBOLS), messages=[MESSAGES[k] for k in MESSAGE_KEYS])


def _handle(launcher: Any) -> int:
    addresses = (launcher.backend.address("forward"), launcher.backend.address("adjoint"))
    if addresses not in _HANDLES:
        h = int(torch.ops.tensorstep_native.register_kernels(*addresses, **table_rows(launcher.table),
                                                            dtype=launcher.dtype))
        _LAUNCHERS[h] = launcher
        _HANDLES[addresses] = h
    return _HANDLES[addresses]
