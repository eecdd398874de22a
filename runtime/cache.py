"""The on-disk kernel cache: content-addressed builds plus a per-spec index.

Layout under the cache root::

    builds/<content-hash>/kernel.<ext>   the compiled artefact
    builds/<content-hash>/source.<ext>   the source it was built from (for inspection)
    builds/<content-hash>/meta.json      sha256 of the artefact (detects truncation/corruption), and
                                         the generator's metadata of the build (coefficient count...)
    index/<spec-key>-<env-key>.json      spec → content hash, so a warm load needs no codegen
    templates/                           Jinja2's compiled templates, where the package's own
                                         templates/__pycache__ cannot be written (codegen/render.py)
    generated/<name>.json                other generated text a warm process reads instead of running
                                         the generator (the cost kinds' PyTorch functions: runtime/costs.py;
                                         the sources `generate` and `run` write: runtime/sources.py)

The content hash covers source + compiler identity + flags + ABI version. Builds take a
per-hash file lock, write to a temporary name and rename, so concurrent processes build
once and nobody ever reads a half-written file.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..codegen.files import atomic_write

ABI_VERSION = "2"  # 2: build metadata stored in meta.json
SLOW_BUILD_S = 2.0  # a wait on builds still running after this long says what it is doing
#: builds that start less than this long after the last one ended are one wait (a load and its first
#: call, a forward and its backward): ``building``'s notice is about the user's wait, not one build
WAIT_GAP_S = 1.0


def slow_notice(what: str, after: Optional[float] = None) -> threading.Timer:
    """A started timer that prints 'tensorstep: <what>...' on stderr unless cancelled within
    ``after`` seconds (for a build's own notice; what is compiled is ``building``'s)."""
    timer = threading.Timer(SLOW_BUILD_S if after is None else after, lambda: print(f"tensorstep: {what}...", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    return timer


class _Wait:
    """The builds the process has run since it last stood WAIT_GAP_S without one (``building``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.since = 0.0  # when the builds now running began
        self.spent = 0.0  # how long some build ran in this wait before ``since``
        self.ended = -math.inf  # when the last build ended
        self.told = False  # this wait's notice printed
        self.built: dict[tuple[str, Any], list[str]] = {}  # (name, horizon) → what, in order
        self.timer: Optional[threading.Timer] = None


_WAIT = _Wait()


class Build:
    """A build ``building`` counts, until ``cancel`` (it ended, or was found built); as a context
    manager, until its block ends."""

    def __init__(self) -> None:
        self._open = True

    def __enter__(self) -> "Build":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()

    def cancel(self) -> None:
        with _WAIT.lock:
            if not self._open:
                return
            self._open = False
            _WAIT.running -= 1
            if _WAIT.running == 0:
                now = time.monotonic()
                _WAIT.spent += now - _WAIT.since
                _WAIT.ended = now
                if _WAIT.timer is not None:
                    _WAIT.timer.cancel()
                    _WAIT.timer = None


def building(name: str, what: str, horizon: Any = None) -> Build:
    """Count a build of ``what`` (e.g. 'core kernels') of kernel ``name`` until its ``cancel``. Once the
    builds of one wait (those less than WAIT_GAP_S apart: one call's, a load's and its first call's)
    have run SLOW_BUILD_S in all, one line on stderr says what they build:
    'tensorstep: compiling <name> (<what>, <what>..., H=<horizon>)...'; once a wait, not once a build."""
    wait = _WAIT
    with wait.lock:
        now = time.monotonic()
        if wait.running == 0:
            if now - wait.ended >= WAIT_GAP_S:  # a new wait
                wait.spent, wait.told, wait.built = 0.0, False, {}
            wait.since = now
            if not wait.told:
                wait.timer = threading.Timer(max(SLOW_BUILD_S - wait.spent, 0.0), _tell)
                wait.timer.daemon = True
                wait.timer.start()
        wait.running += 1
        whats = wait.built.setdefault((name, horizon), [])
        if what not in whats:
            whats.append(what)
    return Build()


def _tell() -> None:
    """The timer of the builds running now: this wait's notice, unless told or ended."""
    wait = _WAIT
    with wait.lock:
        if threading.current_thread() is not wait.timer or wait.told or not wait.running:
            return  # (a timer cancelled as it fired)
        wait.told = True
        kernels = "; ".join(f"{name} ({', '.join(whats)}{'' if horizon is None else f', H={horizon}'})"
                            for (name, horizon), whats in wait.built.items())
        print(f"tensorstep: compiling {kernels}...", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """$TENSORSTEP_CACHE_DIR, else the per-user cache directory."""
    env = os.environ.get("TENSORSTEP_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tensorstep"


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class CacheLockError(OSError):
    """The lock file could not be created or taken."""


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock held on ``path`` (created if needed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError as err:
        raise CacheLockError(str(err)) from err
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def held_elsewhere(path: Path) -> bool:
    """Whether another process holds the lock on ``path`` now (False if there is no lock file)."""
    try:
        with open(path, "r") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        pass
    return False


class CacheError(RuntimeError):
    """The cache directory cannot be used (e.g. read-only with nothing cached)."""


class BuildCache:
    """Content-addressed artefacts with verified reads and locked, atomic builds."""

    def __init__(self, root: Path | None = None):
        self.root = root or cache_root()

    def build_dir(self, content_hash: str) -> Path:
        return self.root / "builds" / content_hash

    def index_path(self, spec_key: str, env_key: str) -> Path:
        return self.root / "index" / f"{spec_key}-{env_key}.json"

    def lookup(self, spec_key: str, env_key: str) -> str | None:
        """Content hash recorded for a spec in this environment, if any."""
        try:
            return json.loads(self.index_path(spec_key, env_key).read_text())["hash"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def verified_artefact(self, content_hash: str, ext: str) -> Path | None:
        """The artefact if present and intact (sha256 matches its meta), else None."""
        folder = self.build_dir(content_hash)
        artefact = folder / f"kernel.{ext}"
        try:
            meta = json.loads((folder / "meta.json").read_text())
            if meta.get("sha256") == file_sha256(artefact):
                return artefact
        except (OSError, ValueError, AttributeError):
            pass
        return None

    def building(self, content_hash: str) -> bool:
        """Whether another process is building this artefact now (holds its build lock)."""
        return held_elsewhere(self.build_dir(content_hash) / ".lock")

    def metadata(self, content_hash: str) -> dict:
        """The generator's metadata stored with a build ({} if none)."""
        try:
            meta = json.loads((self.build_dir(content_hash) / "meta.json").read_text()).get("kernel")
        except (OSError, ValueError, AttributeError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def build(
        self,
        content_hash: str,
        ext: str,
        source: str,
        compile_fn: Callable[[Path, Path], None],
        metadata: Optional[dict] = None,
    ) -> Path:
        """Return the verified artefact, building it under a lock if missing or corrupt."""
        found = self.verified_artefact(content_hash, ext)
        if found:
            return found
        folder = self.build_dir(content_hash)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CacheError(
                f"cannot create the kernel cache folder {folder}: {err}. Set TENSORSTEP_CACHE_DIR to a writable folder."
            ) from err
        try:
            with locked(folder / ".lock"):
                return self._build_locked(folder, content_hash, ext, source, compile_fn, metadata)
        except (PermissionError, CacheLockError) as err:
            raise CacheError(f"cannot write to the kernel cache folder {folder}: {err}") from err

    def _build_locked(self, folder: Path, content_hash: str, ext: str, source: str,
                      compile_fn: Callable[[Path, Path], None], metadata: Optional[dict]) -> Path:
        found = self.verified_artefact(content_hash, ext)  # another process may have built it
        if found:
            return found
        src = folder / f"source.{ext}.src"
        atomic_write(src, source.encode())
        artefact = folder / f"kernel.{ext}"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kernel.", suffix=f".{ext}")
        os.close(fd)
        try:
            compile_fn(src, Path(tmp))
            os.replace(tmp, artefact)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        meta = {"sha256": file_sha256(artefact), "kernel": metadata or {}}
        atomic_write(folder / "meta.json", json.dumps(meta, sort_keys=True).encode())
        return artefact

    def artefact_for(self, index_key: str, env_key: str, ext: str,
                     make_source: Callable[[], tuple[str, dict]],
                     compile_fn: Callable[[Path, Path], None], build: tuple[str, ...] = ()) -> tuple[str, Path, dict]:
        """(content hash, verified artefact, metadata) for a spec: via the index when cached,
        else the source and its metadata are generated (make_source), built and recorded.
        ``build``: what else the artefact depends on (how compile_fn builds this source), in its hash."""
        content_hash = self.lookup(index_key, env_key)
        path = self.verified_artefact(content_hash, ext) if content_hash else None
        if path is None:
            source, metadata = make_source()
            content_hash = digest(source, env_key, *build)
            path = self.build(content_hash, ext, source, compile_fn, metadata)
            self.record(index_key, env_key, content_hash)
        return content_hash, path, self.metadata(content_hash)

    def found(self, name: str, valid: Callable[[dict], bool]) -> Optional[dict]:
        """The JSON object kept as ``generated/<name>.json`` where it is there and ``valid``, else None."""
        try:
            found = json.loads((self.root / "generated" / f"{name}.json").read_text())
            if isinstance(found, dict) and valid(found):
                return found
        except (OSError, ValueError):
            pass
        return None

    def kept(self, name: str, make: Callable[[], dict], valid: Callable[[dict], bool]) -> dict:
        """A generated JSON object kept as ``generated/<name>.json`` (``name`` says what it depends on): read
        where it is there and ``valid`` (``found``), else made (``make``) and written, best effort (a
        read-only cache makes it again in each process)."""
        found = self.found(name, valid)
        if found is not None:
            return found
        made = make()
        with contextlib.suppress(OSError):
            atomic_write(self.root / "generated" / f"{name}.json", json.dumps(made, sort_keys=True).encode())
        return made

    def record(self, spec_key: str, env_key: str, content_hash: str) -> None:
        """Remember which build serves a spec (best effort: a read-only cache just skips it)."""
        with contextlib.suppress(OSError):
            atomic_write(self.index_path(spec_key, env_key), json.dumps({"hash": content_hash}).encode())
