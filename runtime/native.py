"""The native autograd node (runtime/native_node.cpp): build once per PyTorch install, load, route.

Python's autograd.Function adds tens of microseconds per call, more than the kernels cost at
small batches. The native node is one generic C++ op and autograd node that calls the generated
kernels by address, with each spec's argument table registered alongside (its checks, pointer
lists and shapes follow the table). It is compiled against the installed PyTorch's headers
(once per PyTorch install and compiler, see ``node_root``) and used for plain CPU calls:
gradients to the tensor inputs. dt gradients, forward mode and functorch transforms keep the
Python Functions. torch.compile's graphs call runtime/ops.py's ops, whose CPU and autograd
kernels the node registers once a key is bound to its handle (``bind``): a compiled call runs
the same checks and kernels without entering Python. ``TENSORSTEP_NATIVE=0`` turns it off; when it
cannot be built (no C++ compiler, no PyTorch headers) steps run on the Python path with one
warning.

CUDA steps take the same node (``TENSORSTEP_CUDA_NATIVE=0`` turns it off for them alone; a GPU run
checks its launches bit for bit against the Python path's, tests/cuda/test_cuda_native.py): it launches their kernels itself, through the driver's ``cuLaunchKernel``, with the launches
runtime/cuda_backend.py works out (``CudaBackend.native_plan``: asked once per entry point and batch
size, then kept in C++), on PyTorch's current stream, the temporaries from PyTorch's caching
allocator. Without it a CUDA call takes the Python path (autograd.Function, ``Packed``).

Nothing waits for the build: when no node is built yet, a background process builds it
(under its folder's lock, so it completes even if this process exits first) while steps
run on the Python path; a daemon thread loads it when it is done, and steps take it on their
next call (``wait()`` blocks until then).

Where it is kept: not in the kernel cache (``$TENSORSTEP_CACHE_DIR``, which CI and users point
at fresh folders), but in one per-user folder shared by every kernel cache, in PyTorch's own
folder for extension builds (``node_root``), one build per PyTorch install (version, git
revision, location) and compiler (path, size, date, flags). ``torch.utils.cpp_extension.load``
is not used to build it: its build folder is named by the extension and Python/CUDA versions
only, so two PyTorch installs would rebuild over each other's library; its lock is a file whose
existence is the lock, left behind by a killed build (every later load then waits for ever);
it builds in the calling process (this build must outlive it) and needs ninja; and importing it
imports setuptools, more than a warm load costs.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..codegen.arguments import ABSENT, INDEX, KERNEL, MESSAGES, OPTIONAL, REQUIRED, STEP, ArgumentTable
from ..codegen.targets import CUDA_LAUNCHES_KEPT
from . import registry, unbuilt, validate
from .cache import ABI_VERSION, BuildCache, cache_root, digest

SOURCE = Path(__file__).with_name("native_node.cpp")
# -O1: as fast per call as -O2 (BENCHMARKS.md, "The native node's build"), and the back end
# takes less of the build
CXX_FLAGS = ("-O1", "-std=c++17", "-shared", "-fPIC", "-w")
ARTEFACT = "native.so"

#: False makes a load wait for the node (the test suite: each test sees one path throughout)
BACKGROUND = True


def enabled() -> bool:
    """False when TENSORSTEP_NATIVE is 0/false/off/no."""
    return os.environ.get("TENSORSTEP_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


#: the switch of CUDA steps' native node (read when a step is loaded)
CUDA_SWITCH = "TENSORSTEP_CUDA_NATIVE"


def cuda_enabled() -> bool:
    """CUDA steps take the native node unless TENSORSTEP_CUDA_NATIVE or TENSORSTEP_NATIVE is
    0/false/off/no."""
    return enabled() and os.environ.get(CUDA_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _torch_paths() -> tuple[Path, list[Path]]:
    root = Path(torch.__file__).resolve().parent
    return root / "lib", [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]


def torch_extensions_dir() -> Path:
    """PyTorch's folder for extension builds: $TORCH_EXTENSIONS_DIR, else the default of
    ``torch.utils.cpp_extension`` (not imported: it imports setuptools)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    try:
        from torch._appdirs import user_cache_dir
        return Path(os.path.realpath(user_cache_dir(appname="torch_extensions")))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "torch_extensions"


def node_root() -> Path:
    """The folder the node is built into and loaded from, shared by every kernel cache:
    $TENSORSTEP_NATIVE_DIR, else ``tensorstep_native`` in PyTorch's extension folder
    (~/.cache/torch_extensions by default)."""
    env = os.environ.get("TENSORSTEP_NATIVE_DIR")
    return Path(env) if env else torch_extensions_dir() / "tensorstep_native"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _cxx() -> Optional[str]:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((p for p in map(shutil.which, candidates) if p), None)


def command(cxx: str, src: Path, out: Path) -> list[str]:
    """The compiler command that builds the node from ``src`` into ``out``."""
    lib, includes = _torch_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes), "-x", "c++",
            str(src), "-o", str(out), f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10"]


def build_key(cxx: str, source: str) -> str:
    """Content hash of the node's build: source, compiler (path, date, size), the whole command
    (flags, PyTorch's include and library folders), PyTorch's version and git revision."""
    st = os.stat(os.path.realpath(cxx))
    return digest(source, os.path.realpath(cxx), str(st.st_mtime_ns), str(st.st_size),
                  " ".join(command(cxx, Path("{src}"), Path("{out}"))), torch.__version__,
                  str(getattr(torch.version, "git_version", "")), ABI_VERSION, platform.machine())


#: the build process's niceness (os.nice): the node's build, which no call waits for, gives the cores
#: to the kernels' builds and calls that a program waits for
BUILD_NICENESS = 10

# The build process: BuildCache.build with the compiler command ({src} and {out} filled in), the
# job on stdin. It imports only the cache module (no PyTorch), and outlives this process if need be.
_BUILDER = r"""
import importlib, json, os, subprocess, sys
from pathlib import Path
job = json.load(sys.stdin)
os.nice(job["nice"])
sys.path[:0] = job["path"]
cache = importlib.import_module(job["module"])
def compile_fn(src, out):
    command = [a.replace("{src}", str(src)).replace("{out}", str(out)) for a in job["command"]]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit("C++ compilation failed:\n" + result.stderr[-3000:])
try:
    cache.BuildCache(Path(job["root"])).build(job["key"], job["ext"], job["source"], compile_fn)
except cache.CacheError as err:
    sys.exit(str(err))
"""


def _start_build(cxx: str, key: str, source: str, root: Path) -> Callable[[], None]:
    """Start the build process (the node into the cache at ``root``); the returned function waits
    for it and raises RuntimeError if it failed. Started here, not in the waiting thread, so that
    it runs even if this process exits at once."""
    job = dict(path=sys.path, module=BuildCache.__module__, root=str(root), key=key, ext=ARTEFACT,
               source=source, command=command(cxx, Path("{src}"), Path("{out}")), nice=BUILD_NICENESS)
    # a session of its own: a Ctrl-C (the terminal's or a notebook's, sent to this process's group)
    # stops what the program waits for, not this build, which would leave the node off until a restart
    process = subprocess.Popen([sys.executable, "-c", _BUILDER], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    with process.stdin:
        process.stdin.write(json.dumps(job))

    def finish() -> None:
        with process.stderr:
            errors = process.stderr.read()
        if process.wait() != 0:
            raise RuntimeError(errors.strip()[-3000:] or f"the build process exited with {process.returncode}")

    return finish


_LOCK = threading.Lock()
_STARTED = False
_DONE = threading.Event()  # set once the node is loaded, or known to be unavailable
_PATH: Optional[Path] = None
_ROOT: Optional[Path] = None  # the folder the node is built into (set when a build starts)
_FAILURE: Optional[str] = None  # why there is no node, warned once (in a caller's thread)


def start() -> None:
    """Make the node available without waiting: load it from the cache now, or start its build in
    the background. Once per process (the node registers ops, which cannot happen twice)."""
    global _STARTED
    with _LOCK:
        if _STARTED:
            return
        _STARTED = True
        build = _begin()
    if build is not None:
        threading.Thread(target=_finish_and_load, args=build, name="tensorstep-native-build", daemon=True).start()


def _begin() -> Optional[tuple[Callable[[], None], str]]:
    """Settle the node now if possible (off, impossible, built); else start its build:
    (the function that waits for it, its cache key)."""
    global _ROOT
    if not enabled() or platform.system() == "Windows":
        return _settle(None)
    cxx = _cxx()
    _, includes = _torch_paths()
    if cxx is None or not (includes[0] / "torch" / "library.h").exists():
        return _settle(None, "no C++ compiler or PyTorch headers, so the native autograd node is not built; steps "
                             "use the Python autograd path (correct, more overhead per call). Install g++ to enable it.")
    try:
        source = SOURCE.read_text()
        key = build_key(cxx, source)
        shared = node_root()
        for root in (shared, cache_root()):  # the kernel cache holds it where the shared folder is read-only
            found = BuildCache(root).verified_artefact(key, ARTEFACT)
            if found is not None:
                return _settle(*_load(found))
        if _writable(shared):
            _ROOT, where = shared, f"once per PyTorch install and compiler, into {shared}"
        else:
            _ROOT, where = cache_root(), (f"into the kernel cache: {shared} cannot be written; TENSORSTEP_NATIVE_DIR "
                                          "names a folder for it that every cache shares")
        doing = "another process is building" if BuildCache(_ROOT).building(key) else "building"
        print(f"tensorstep: {doing} the native autograd node for torch {torch.__version__} in the background "
              f"({where}); steps use the Python autograd path until it is ready", file=sys.stderr, flush=True)
        return _start_build(cxx, key, source, _ROOT), key
    except OSError as err:
        return _settle(None, _failed(err))


def _finish_and_load(finish: Callable[[], None], key: str) -> None:
    try:
        finish()
        path = BuildCache(_ROOT).verified_artefact(key, ARTEFACT)
        if path is None:
            raise RuntimeError("the built node is missing from the cache")
    except Exception as err:  # the thread's end: whatever went wrong, steps stay on the Python path
        _settle(None, _failed(err))
        return
    _settle(*_load(path))


def _load(path: Path) -> tuple[Optional[Path], Optional[str]]:
    try:
        torch.ops.load_library(str(path))
    except (RuntimeError, OSError) as err:
        return None, _failed(err)
    _register_python_parts()
    flag = ctypes.CDLL(str(path)).tensorstep_unbuilt  # the library loaded already: its handle
    flag.argtypes, flag.restype = (ctypes.c_int32,), None
    unbuilt.FLAG = flag
    return path, None


def _failed(err: Exception) -> str:
    return f"the native autograd node could not be built or loaded ({err}); steps use the Python autograd path"


def _settle(path: Optional[Path], failure: Optional[str] = None) -> None:
    global _PATH, _FAILURE
    _PATH, _FAILURE = path, failure
    _DONE.set()


def _warn_once() -> None:
    global _FAILURE
    with _LOCK:
        failure, _FAILURE = _FAILURE, None
    if failure:
        warnings.warn(f"tensorstep: {failure}", stacklevel=4)


def ready() -> bool:
    """True once the node is loaded or known to be unavailable (then it never changes)."""
    return _DONE.is_set()


def wait(timeout: Optional[float] = None) -> Optional[Path]:
    """The built node, waiting for its build; None when off, impossible (warned) or still building
    after ``timeout`` seconds."""
    start()
    _DONE.wait(timeout)
    if not _DONE.is_set():
        return None
    _warn_once()
    return _PATH


def library() -> Optional[Path]:
    """The built node (from the cache, else built now, waiting for it); None when off or impossible."""
    return wait()


_PYTHON_IMPL: Optional[torch.library.Library] = None
# A handle is the node's entry for one library's kernels (their addresses and argument table), kept
# for the process as the library is (runtime/cbackend.py: nothing unloads one), one per spec loaded:
# a graph that outlives its step calls them by handle. Its launcher is held weakly (the step holds
# it), and found again by its kernel key where the step is gone (``launcher``).
_LAUNCHERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_KEYS: dict[int, str] = {}  # handle → kernel key (runtime/registry.py)
_HANDLES: dict[tuple[int, int], int] = {}  # kernel addresses → handle: loading a spec again reuses it


def _register_python_parts() -> None:
    """The op the node calls back into Python for a create_graph adjoint: AdjointFunction, which is
    differentiable (backward, jvp, vmap). The node's CPU kernels for torch.compile's ops call back
    into runtime/ops.py, which registers those implementations itself (``ops._serve_node``)."""
    from .autograd import AdjointFunction, _recomputed

    def adjoint_graph(handle: int, grads: list, dt: torch.Tensor, batch: int) -> list[torch.Tensor]:
        return list(AdjointFunction.apply(launcher(handle), dt, batch, *grads))

    def adjoint_graph_fused(handle: int, inputs: list, grads: list, dt: torch.Tensor) -> list[torch.Tensor]:
        """A fused step's create_graph backward (its composite form): each differentiable input's
        gradient, in table order (an empty tensor where there is none)."""
        found = launcher(handle)
        rows = [a.differentiable and a.dtype == KERNEL for a in found.table.tensors]
        needed = tuple(row and x is not None and x.requires_grad for row, x in zip(rows, inputs)) + (False,)
        got = _recomputed(found, inputs, dt, tuple(grads), needed)
        return [g if g is not None else dt.new_empty(0) for g, row in zip(got, rows) if row]

    global _PYTHON_IMPL
    _PYTHON_IMPL = torch.library.Library("tensorstep_native", "IMPL")  # kept alive: it holds the registration
    _PYTHON_IMPL.impl("adjoint_graph", adjoint_graph, "CompositeImplicitAutograd")
    _PYTHON_IMPL.impl("adjoint_graph_fused", adjoint_graph_fused, "CompositeImplicitAutograd")
    _PYTHON_IMPL.impl("raise_unbuilt", unbuilt.raise_unbuilt, "CompositeImplicitAutograd")
    _PYTHON_IMPL.impl("cuda_plan", lambda handle, entry, batch: _CUDA_BACKENDS[handle].native_plan(entry, batch),
                      "CompositeImplicitAutograd")


def handle(launcher: Any) -> Optional[int]:
    """Register a launcher's kernels with the node; None when the node is unavailable or still
    building (never waits, unless BACKGROUND is False), and for CUDA kernels unless ``cuda_enabled``
    and their backend launches them directly (``CudaBackend.direct``)."""
    cuda = _is_cuda(launcher.backend)
    if cuda and not (cuda_enabled() and launcher.backend.direct):
        return None
    if not _DONE.is_set():
        start()
        if not BACKGROUND:
            wait()
        if not _DONE.is_set():
            return None
    _warn_once()
    if _PATH is None:
        return None
    with _LOCK:
        return _cuda_handle(launcher) if cuda else _handle(launcher)


def bind(key: str, handle: int, family: str) -> None:
    """torch.compile's ops (runtime/ops.py) run ``key``'s CPU calls in the node with ``handle``'s
    kernels, entering no Python (the node registers its CPU kernels for ``family``'s ops)."""
    torch.ops.tensorstep_native.bind(key, handle, family)


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
        output_shapes=[c for y in table.outputs for c in _codes(table.symbolic(y))],
        output_ranks=[len(table.symbolic(y)) for y in table.outputs],
        symbols=list(SYMBOLS), messages=[MESSAGES[k] for k in MESSAGE_KEYS], fused=table.fused,
        kept=[int(validate.cost_parameter(a)) for a in table.inputs])


def _handle(launcher: Any) -> int:
    addresses = (launcher.backend.address("forward"), launcher.backend.address("adjoint"))
    h = _HANDLES.get(addresses)
    if h is None:
        h = int(torch.ops.tensorstep_native.register_kernels(*addresses, **table_rows(launcher.table),
                                                            dtype=launcher.dtype))
        _KEYS[h] = registry.key_for(launcher.spec, torch.device("cpu"))
        _HANDLES[addresses] = h
    if _LAUNCHERS.get(h) is None:
        _LAUNCHERS[h] = launcher
    return h


def _is_cuda(backend: Any) -> bool:
    """A CUDA backend (runtime/cuda_backend.py, not imported: a CPU program never needs it)."""
    return hasattr(backend, "native_plan")


# A CUDA handle's backend, while its modules may be launched: the step's launcher holds its anchor,
# and so does each autograd node of the handle until its backward ran (native_node.cpp
# ``Kernels::anchor``); the anchor holds the backend. Freed with the last of them, its modules with it.
_CUDA_BACKENDS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_ANCHORS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


class _Holder(bytearray):
    """The memory of a CUDA handle's anchor (a tensor on it, ``torch.frombuffer``, which holds this
    object until its storage is freed), holding the backend whose modules the node launches. Not
    held by the backend: a cycle through a tensor's storage is one the collector cannot see."""

    backend: Any


def _anchor(backend: Any) -> torch.Tensor:
    holder = _Holder(1)
    holder.backend = backend
    return torch.frombuffer(holder, dtype=torch.uint8)


def _cuda_handle(launcher: Any) -> int:
    backend = launcher.backend
    h = getattr(backend, "native_handle", None)
    anchor = _ANCHORS.get(h) if h is not None else None
    if anchor is None:  # new, or every launcher and graph of its handle was freed: a handle afresh
        anchor = _anchor(backend)
        launch, stream = backend.native_launch
        h = int(torch.ops.tensorstep_native.register_kernels(
            0, 0, **table_rows(launcher.table), dtype=launcher.dtype, cuda=True, device=str(backend.device),
            launch=launch, stream=stream, plans_kept=CUDA_LAUNCHES_KEPT, anchor=anchor))
        _KEYS[h] = registry.key_for(launcher.spec, backend.device)
        _CUDA_BACKENDS[h] = backend
        _ANCHORS[h] = anchor
        backend.native_handle = h
    launcher.native_anchor = anchor  # the step's launcher holds its kernels loaded
    if _LAUNCHERS.get(h) is None:
        _LAUNCHERS[h] = launcher
    return h


def cuda_plans(handle: int) -> tuple[int, int]:
    """A CUDA handle's launches kept in the node, and how many times it asked Python for them."""
    kept, asked = torch.ops.tensorstep_native.cuda_plans(handle)
    return int(kept), int(asked)


def launcher(handle: int) -> Any:
    """The launcher of a handle's kernels: a live one, else its key's (loaded again where no step holds
    one: a graph that outlived its step)."""
    found = _LAUNCHERS.get(handle)
    return found if found is not None else registry.launcher(_KEYS[handle])


@functools.lru_cache(maxsize=None)
def _slot_release() -> Callable[[int], None]:
    """The node's ``tensorstep_release_slot`` through ctypes: a finalizer that calls no op, so a step
    collected while another program is traced (torch.export) leaves nothing in that program's graph."""
    release = ctypes.CDLL(str(_PATH)).tensorstep_release_slot  # the library loaded already: its handle
    release.argtypes, release.restype = (ctypes.c_int64,), None
    return release


class Slot:
    """A step's place in the node for the cost parameters that passed its checks (native_node.cpp
    ``keep``): while a call passes the same tensors unchanged, the node takes it without asking
    Python. Released with the step."""

    def __init__(self) -> None:
        self.id = int(torch.ops.tensorstep_native.new_slot())
        self._release = _slot_release()

    def keep(self, handle: int, given: list, inputs: list, held: int = -1) -> None:
        """``given``'s cost parameters (the call's arguments, dt last) passed every check; ``inputs``:
        what the kernels read for them (a [D] weight's [B, D] rows, defaults for missing ones);
        ``held`` (>= 0): they are the step's held parameters (Step.set_costs) of that generation, which
        later calls may then leave out (the node compares each with its stamp)."""
        torch.ops.tensorstep_native.keep.default(handle, self.id, given, inputs, held)

    def __del__(self) -> None:
        try:
            self._release(self.id)
        except Exception:  # at interpreter exit the op may already be gone, and the process with it
            pass
