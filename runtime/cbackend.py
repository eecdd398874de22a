"""C backend: compile generated C with the system compiler, load it through cffi (ABI mode)."""
from __future__ import annotations

import _thread
import contextlib
import ctypes
import functools
import importlib.util
import io
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import cffi

from ..codegen import abi
from ..codegen.arguments import table
from .cache import ABI_VERSION, BuildCache, CacheError, building, digest
from .fingerprint import generator_fingerprint
from .unbuilt import keep as keep_unbuilt

# -fopenmp: the batch loop runs on all cores; the library links libgomp.so.1, the same soname
# PyTorch ships, so one OpenMP runtime serves both.
C_FLAGS = ("-O3", "-march=native", "-std=gnu99", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp")
# x86-64: the vectoriser's loops (position control's interior rows) in 256-bit vectors, as gcc's
# own tuning for Intel's AVX-512 server cores has it; where gcc tunes an AVX-512 AMD core as an
# older one, its 512-bit loops were slower (docs/benchmarks-history.md, eighteenth session). The dof lanes'
# explicit vector types are not affected.
if platform.machine().lower() in ("x86_64", "amd64"):
    C_FLAGS += ("-mprefer-vector-width=256",)


@functools.lru_cache(maxsize=1)
def c_flags() -> tuple[str, ...]:
    """The compiler flags: C_FLAGS plus $TENSORSTEP_CFLAGS (part of the cache key)."""
    return C_FLAGS + tuple(os.environ.get("TENSORSTEP_CFLAGS", "").split())


class CompilerNotFound(RuntimeError):
    """No usable C compiler."""


class CompileError(RuntimeError):
    """A C source did not compile; the compiler's output is kept in ``stderr``."""

    def __init__(self, command: list[str], source: str, stderr: str):
        self.source, self.stderr = source, stderr  # source: the compiled file (callers may name theirs)
        super().__init__(f"C compilation failed ({' '.join(command)}):\n{stderr[-4000:]}")

    def summary(self) -> str:
        """One line: the source and the compiler's first error, located by line and column."""
        for line in self.stderr.splitlines():
            if "error" in line:
                where, _, message = line.rpartition(" error: ") if " error: " in line else ("", "", line)
                position = where.rstrip(":").split(":")[-2:] if where.count(":") >= 2 else []
                at = f" (line {':'.join(position)})" if position else ""
                return f"{self.source} does not compile{at}: {message.strip()}"
        return f"{self.source} does not compile (the compiler gave no error message)"


class BuildStopped(CompileError):
    """The compiler was killed by a signal (a Ctrl-C reaches the compiler, in this process's group,
    too): not a failed build, which the next use tries again."""

    def __init__(self, command: list[str], source: str, stderr: str, returncode: int):
        self.signal = _signal_name(-returncode)
        super().__init__(command, source, stderr)
        self.args = (f"the C compiler was stopped by {self.signal} while it built {source}; "
                     "the next use builds it again",)

    def summary(self) -> str:
        return str(self)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _checked(command: list[str], src: str, returncode: int, stderr: str) -> None:
    """Raise for a compiler that failed (CompileError) or was killed by a signal (BuildStopped)."""
    if returncode < 0:
        raise BuildStopped(command, src, stderr, returncode)
    if returncode != 0:
        raise CompileError(command, src, stderr)


@functools.lru_cache(maxsize=1)
def compiler() -> str:
    """Path of the C compiler: $CC, else cc or gcc on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise CompilerNotFound(
        f"no C compiler found (looked for {', '.join(candidates)}): install one, "
        "e.g. 'apt-get install gcc' (Debian/Ubuntu), or set CC to its path"
    )


@functools.lru_cache(maxsize=1)
def environment_key() -> str:
    """Identity of compiler + flags + ABI + generator: part of every cache key (cheap: stat only)."""
    cc = os.path.realpath(compiler())
    st = os.stat(cc)
    return digest(cc, str(st.st_mtime_ns), str(st.st_size), " ".join(c_flags()), ABI_VERSION,
                  platform.machine(), generator_fingerprint())[:16]


def _compile(src: Path, out: Path, units: int = 1, defines: tuple[str, ...] = ()) -> None:
    """Compile a C source into a shared library: in one piece, or, on a machine with more than
    one core, as ``units`` translation units (``-DTS_UNIT=1..units``: see abi.units and
    templates/kernel.c.j2) compiled side by side and linked. ``defines``: ``-D`` switches of the
    source (``NAME`` or ``NAME=value``)."""
    switches = [f"-D{d}" for d in defines]
    if units <= 1 or cores() <= 1:
        _run([compiler(), *c_flags(), *switches, "-x", "c", str(src), "-o", str(out)], src)
        return
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".units.") as folder:
        objects = [str(Path(folder) / f"unit{i}.o") for i in range(1, units + 1)]
        commands = [[compiler(), *c_flags(), *switches, f"-DTS_UNIT={i}", "-c", "-x", "c", str(src), "-o", o]
                    for i, o in enumerate(objects, 1)]
        processes = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for cmd in commands]
        errors = [process.communicate()[1] for process in processes]  # wait for every one
        stopped = sorted(zip(commands, processes, errors), key=lambda c: c[1].returncode >= 0)  # a signal first
        for cmd, process, stderr in stopped:
            _checked(cmd, str(src), process.returncode, stderr)
        _run([compiler(), *c_flags(), *objects, "-o", str(out)], src)


def library_build(part: str, spec: Any = None, defines: tuple[str, ...] = ()) -> Callable[[Path, Path], None]:
    """How a library of ``part``'s kernels (abi.PARTS, those the spec has) is compiled from its
    source: in the units abi.units names (``_compile``), with the ``-D`` switches ``defines``."""
    return functools.partial(_compile, units=len(abi.units(part, None if spec is None else table(spec))),
                             defines=defines)


#: the switch of a fused step's core library as the runtime builds it: the entry points alone, each
#: form of its kernels (the general one and those of codegen/fused.py ``forms``) built in a library of
#: its own on the first call that runs it (``Forms``; templates/kernel.c.j2): a first load compiles no
#: form, the first call the one it runs
LAZY_FORMS = "TS_LAZY_FORMS"
#: the general form's number (templates/kernel.c.j2 ``TS_FORM``; the variants' are from 1)
GENERAL = 0


def lazy_forms(spec: Any, part: str) -> bool:
    """Whether the runtime builds this library with ``LAZY_FORMS``: a fused core with cost terms (its
    C entry points have forms besides the general one: unit row weights at least)."""
    return part == "core" and bool(table(spec).costs)


def _run(cmd: list[str], src: Path) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    _checked(cmd, str(src), result.returncode, result.stderr)


@functools.lru_cache(maxsize=1)
def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cdef(spec: Any, part: str) -> str:
    """cffi declarations of one library's entry points; pointers are passed as integers."""
    args = table(spec)
    lines = []
    for kernel in abi.part_kernels(part, args):
        params = ", ".join(("intptr_t" if "*" in t else t) + f" {n}" for t, n in abi.arguments(kernel, args))
        lines.append(f"void {abi.symbol(spec.name, kernel)}({params});")
        if lazy_forms(spec, part):
            lines.append(f"void {abi.symbol(spec.name, kernel)}_forms(intptr_t hook);")
    return "\n".join(lines)


#: content hash → (cffi module, loaded library), kept for the process: nothing unloads a library, as the
#: native node's handles (runtime/native.py) and a graph that outlives its step call its kernels by
#: address. One per library a process loads (a spec's core, and its dt libraries where used): its code
#: and cffi's bindings, not the steps, launchers or tensors, which are freed with their steps.
_LOADED: dict[str, Any] = {}


def load_library(spec: Any, part: str = "core", cache: BuildCache | None = None) -> tuple[Any, dict]:
    """One loaded cffi library of a spec (see ``abi.LIBRARIES``) and its build metadata: from the
    cache, else generated (codegen's driver) and built.

    An unusable cache folder (read-only, or not a folder) falls back to a private temporary
    cache with a warning, so a kernel still loads.
    """
    return _with_fallback(cache or BuildCache(), lambda c: _load_library(spec, part, c), stacklevel=4)


@functools.lru_cache(maxsize=1)
def fallback_cache_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="tensorstep-cache-"))


def _with_fallback(cache: BuildCache, use: Callable[[BuildCache], Any], stacklevel: int) -> Any:
    """``use(cache)``; where the cache folder is unusable (CacheError), ``use`` of a private temporary
    cache for this process, with a warning (``stacklevel``: the frame it names)."""
    try:
        return use(cache)
    except CacheError as err:
        fallback = BuildCache(fallback_cache_root())
        warnings.warn(f"{err}; using a temporary kernel cache at {fallback.root} for this process",
                      stacklevel=stacklevel)
        return use(fallback)


def _load_library(spec: Any, part: str, cache: BuildCache) -> tuple[Any, dict]:
    lazy = lazy_forms(spec, part)
    content_hash, path, metadata = _artefact(spec, part, cache, f"{spec.key}-{part}", f"{part} kernels",
                                             () if lazy else None, (LAZY_FORMS,) if lazy else ())
    lib = _open(content_hash, path, spec, part)
    if lazy:  # one hook per library, kept alive here (threads loading it at once set the same one)
        forms = _FORMS.get(content_hash) or _FORMS.setdefault(content_hash, Forms(spec, part, cache))
        for kernel in abi.part_kernels(part, table(spec)):
            getattr(lib, f"{abi.symbol(spec.name, kernel)}_forms")(forms.address)
    return lib, metadata


def _artefact(spec: Any, part: str, cache: BuildCache, index_key: str, what: str,
              forms: Optional[tuple[int, ...]], defines: tuple[str, ...]) -> tuple[str, Path, dict]:
    """(content hash, verified artefact, metadata) of a library of ``part`` (``what``, in words): from the
    cache, else generated with the variants ``forms`` (codegen/driver.py ``generate``) and compiled with
    the ``-D`` switches ``defines``."""
    notices = []

    def generate() -> tuple[str, dict]:
        # timed from here: the generator's imports (SymPy, Jinja2) are part of the wait
        notices.append(building(spec.name, what, spec.horizon))
        from ..codegen.driver import generate  # SymPy and Jinja2 only on a cache miss
        from ..codegen.render import keep_templates

        keep_templates(cache.root / "templates")
        generated = generate(spec, targets=("c",), parts=(part,), forms=forms)
        return generated.source("c", part), dict(generated.metadata)

    try:
        return cache.artefact_for(index_key, environment_key(), "so", generate, library_build(part, spec, defines),
                                  defines)
    finally:
        for notice in notices:
            notice.cancel()


#: by the content hash of the library whose hook each is: kept with that library (``_LOADED``), whose
#: entry points call the hook's address
_FORMS: dict[str, "Forms"] = {}
INTERRUPT_AGAIN_S = 0.02  # a Ctrl-C during a form's build: raised again after this long (``Forms``)
_HOOKS = cffi.FFI()


class Forms:
    """The forms of a fused core library built with ``LAZY_FORMS``: the hook its entry points call on
    the first call that runs a form (``form``: ``GENERAL`` or a variant's, from 1, and the name of its
    batch function), which finds the form's library in the cache, or generates and builds it (a
    source with that form's batch functions, compiled with ``-DTS_FORM=<form>``: them alone), while
    the call waits, and returns the function's address. Nothing is built that no call runs, and
    nothing in the background: which form a call runs depends on its parameters and on which builds
    failed, never on timing. Where a variant cannot be built, the hook says why and returns 0: the
    entry point asks for the general form, built then (the same states and gradients; a cost may
    differ in its last bits). Where the general form cannot be built either, the call writes no
    output: the hook keeps why (runtime/unbuilt.py), which the call raises once the kernel has
    returned."""

    def __init__(self, spec: Any, part: str, cache: BuildCache):
        self.spec, self.part, self.cache = spec, part, cache
        self._lock = threading.Lock()
        self._libraries: dict[int, ctypes.CDLL] = {}
        self._failed: dict[int, Exception] = {}  # why each form that failed to build did
        self._interrupted = False  # a Ctrl-C while this call's form was built: the rest of the call builds nothing
        self._asked = threading.local()  # the variant this thread's call asked for, where it was not found
        self._hook = _HOOKS.callback("intptr_t(int64_t, const char *)", self._find)
        #: what the entry points' ``<kernel>_forms`` take
        self.address = int(_HOOKS.cast("intptr_t", self._hook))

    def _find(self, form: int, symbol: Any) -> int:
        name = _HOOKS.string(symbol).decode()
        then = "this call runs the general form" if form != GENERAL else "this call writes no output and raises"
        # the variant this thread's call asked for before the general form (set where it was not found)
        asked = self._asked.__dict__.pop("name", None) if form == GENERAL else None
        try:
            if self._interrupted:
                return 0
            try:
                found = self.find(form, name)
                if not found:  # it failed before: this call, too, runs without it
                    self._missing(form, name, asked, self._failed.get(form))
                return found
            except BuildStopped as err:  # not a failed build: the next call that runs the form tries again
                self._missing(form, name, asked, err)
                warnings.warn(f"tensorstep: {self.spec.name}: the build of the {_form_name(self.spec, name)} form of "
                              f"its kernels was stopped by {err.signal}; {then}, the next one that runs that form "
                              "builds it", stacklevel=1)
                return 0
            except Exception as err:  # noqa: BLE001 (nothing can be raised through the kernel)
                self._failed[form] = err
                self._missing(form, name, asked, err)
                warnings.warn(f"tensorstep: {self.spec.name}: the {_form_name(self.spec, name)} form of its kernels "
                              f"could not be built ({type(err).__name__}: {err}); "
                              f"{'its calls run the general form' if form != GENERAL else then}", stacklevel=1)
                return 0
        except KeyboardInterrupt:  # (also where it comes while a handler above runs)
            # raised in this callback, cffi would print it and go on: raised again in the main thread a
            # moment later, once the kernel has returned (not at once: that raises it here); until
            # then the call builds nothing more (the general form it would ask for next)
            self._interrupted = True
            again = threading.Timer(INTERRUPT_AGAIN_S, self._interrupt)
            again.daemon = True
            again.start()
            return 0

    def _missing(self, form: int, name: str, asked: Optional[str], err: Optional[BaseException]) -> None:
        """A form this thread's call asked for was not found: the general form's failure is kept for
        the call to raise (runtime/unbuilt.py); a narrower one's name, for that message."""
        if form == GENERAL:
            keep_unbuilt(err, self._unbuilt(name, asked))
        else:
            self._asked.name = name

    def _unbuilt(self, general: str, asked: Optional[str]) -> str:
        """The kernel a call that found no form ran, and the forms it asked for, in words."""
        kernel = next((k for k in abi.KERNELS if general.startswith(f"{self.spec.name}_{k}_")), "?")
        tried = f"its {_form_name(self.spec, asked)} form, then the general one" if asked else "its general form"
        return f"the {kernel} kernel of {self.spec.name} ({tried})"

    def _interrupt(self) -> None:
        self._interrupted = False
        _thread.interrupt_main()

    def find(self, form: int, symbol: str) -> int:
        """The address of ``symbol`` in form ``form``'s library, built if needed (0 after a failed build)."""
        with self._lock:
            if form in self._failed:
                return 0
            lib = self._libraries.get(form)
            if lib is None:
                lib = self._libraries[form] = ctypes.CDLL(str(self._build(form, symbol)))
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value or 0

    def _build(self, form: int, symbol: str) -> Path:
        args = (f"{self.spec.key}-{self.part}-form{form}", f"the {_form_name(self.spec, symbol)} form of its "
                f"{self.part} kernels", (form,), (f"TS_FORM={form}",))
        return _with_fallback(self.cache, lambda c: _artefact(self.spec, self.part, c, *args)[1], stacklevel=2)


def _form_name(spec: Any, symbol: str) -> str:
    """A form's name from its batch function's (``<spec>_<kernel><suffix>_batch_form``): e.g. 'narrow_unit_rows'."""
    rest = symbol[len(spec.name) + 1:].removesuffix("_batch_form")
    for kernel in abi.KERNELS:
        rest = rest.removeprefix(kernel)
    return rest.strip("_") or "general"


def load_source(spec: Any, source: str, metadata: dict, cache: BuildCache | None = None) -> tuple[Any, dict]:
    """Build and load a given C source holding all of a spec's kernels (e.g. from `generate`),
    with the metadata its manifest recorded."""
    cache = cache or BuildCache()
    content_hash = digest(source, environment_key())
    return _open(content_hash, cache.build(content_hash, "so", source, library_build("all", spec), metadata), spec,
                 "all"), metadata


def address(lib: Any, symbol: str) -> int:
    """The address of a loaded library's function (for the native autograd node)."""
    ffi = next(f for f, loaded in _LOADED.values() if loaded is lib)
    return int(ffi.cast("intptr_t", getattr(lib, symbol)))


def _open(content_hash: str, path: Path, spec: Any, part: str) -> Any:
    """dlopen a built library through its pre-parsed cffi module (no C parsing on warm loads)."""
    if content_hash not in _LOADED:
        ffi = _ffi_module(path.parent / f"ffi_{part}.py", spec, part).ffi
        _LOADED[content_hash] = (ffi, ffi.dlopen(str(path)))
    return _LOADED[content_hash][1]


def _ffi_module(module_path: Path, spec: Any, part: str) -> Any:
    """cffi's out-of-line ABI mode: the declarations parsed once, saved as a Python module."""
    if not module_path.exists():
        builder = cffi.FFI()
        builder.cdef(cdef(spec, part))
        builder.set_source(f"_tensorstep_ffi_{spec.name}_{part}", None)
        fd, tmp = tempfile.mkstemp(dir=module_path.parent, prefix=f".{module_path.stem}.", suffix=".tmp")
        os.close(fd)  # a unique name per writer: concurrent processes never share a temporary
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # cffi announces what it writes
                builder.emit_python_code(tmp)
            os.replace(tmp, module_path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    loader_spec = importlib.util.spec_from_file_location(f"_tensorstep_ffi_{module_path.parent.name}_{part}", module_path)
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception:  # a damaged module: rebuild it once
        module_path.unlink(missing_ok=True)
        return _ffi_module(module_path, spec, part)
    return module
