"""Writing generated sources for a robot config: sources, headers, manifest.json.

Deterministic (same input, same bytes), atomic (a file is written under a temporary name
and renamed), and careful: a file that exists and was not written by tensorstep — or was
edited since — is never overwritten unless the caller forces it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from ..version import __version__
from .files import atomic_write
from .targets import target as target_of

MANIFEST = "manifest.json"
#: what `tensorstep generate --target` writes: the sources of each target named, with the header
TARGET_SETS = {"c": ("c", "header"), "cuda": ("cuda", "header"), "all": ("c", "cuda", "header")}


class OverwriteError(RuntimeError):
    """Refused to overwrite files that tensorstep did not write."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(folder: Path) -> Optional[dict[str, Any]]:
    """The manifest in a folder if it is tensorstep's, else None."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == "tensorstep" else None


def _owned_files(manifest: Optional[dict[str, Any]]) -> dict[str, str]:
    """file name → sha256 recorded by an earlier generate."""
    owned: dict[str, str] = {}
    for kernel in (manifest or {}).get("kernels", []):
        for entry in kernel.get("files", {}).values():
            owned[entry["path"]] = entry["sha256"]
    return owned


#: what ``plan`` asks for each spec's sources: (spec, targets) → target → source text
Sources = Callable[[Any, tuple[str, ...]], dict[str, str]]


def generated(spec: Any, targets: tuple[str, ...]) -> dict[str, str]:
    """Each target's source of a spec's kernels, from the generator (codegen/driver.py ``generate``)."""
    from .driver import generate

    made = generate(spec, targets=targets)
    return {t: made.source(t) for t in targets}


def plan(config: Any, target: str, sources: Sources = generated) -> dict[str, bytes]:
    """file name → bytes for every source of every kernel, and the manifest (``sources``: where the
    text comes from, the generator or what a cache kept of it: runtime/sources.py ``kept``)."""
    files: dict[str, bytes] = {}
    for spec in config.specs:
        texts = sources(spec, TARGET_SETS[target])
        for t in TARGET_SETS[target]:
            files[f"{spec.name}.{target_of(t).extension}"] = texts[t].encode()
    files[MANIFEST] = plan_manifest(config, target, files)
    return files


def plan_manifest(config: Any, target: str, files: dict[str, bytes]) -> bytes:
    """manifest.json: the config's robot data, each kernel's spec and its files' hashes."""
    kernels = []
    for spec in config.specs:
        entry: dict[str, Any] = {"name": spec.name, "spec": spec.to_dict(), "files": {}}
        for t in TARGET_SETS[target]:
            name = f"{spec.name}.{target_of(t).extension}"
            entry["files"][t] = {"path": name, "sha256": sha256(files[name])}
        kernels.append(entry)
    manifest = {"tool": "tensorstep", "version": __version__, **config.to_dict(), "target": target, "kernels": kernels}
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


@dataclasses.dataclass
class WriteReport:
    """What `write` did: files whose bytes changed, files already up to date, and the files of
    kernels an earlier manifest listed that the new plan lacks (removed when tensorstep wrote
    them and they are unchanged since; left, and named, when they were edited)."""

    written: list[Path] = dataclasses.field(default_factory=list)
    unchanged: list[Path] = dataclasses.field(default_factory=list)
    removed: list[Path] = dataclasses.field(default_factory=list)
    left: list[Path] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """How many files changed: 'wrote N files (M unchanged)', or 'nothing changed (...)'."""
        if not self.written:
            return f"nothing changed ({len(self.unchanged)} files up to date)"
        return f"wrote {len(self.written)} files" + (f" ({len(self.unchanged)} unchanged)" if self.unchanged else "")

    def notes(self) -> list[str]:
        """One line each for an earlier config's files that were removed or left."""
        lines = []
        if self.removed:
            lines.append(f"removed {len(self.removed)} files of kernels no longer in the config: {_names(self.removed)}")
        if self.left:
            lines.append(f"left {len(self.left)} files of kernels no longer in the config (edited since "
                         f"tensorstep wrote them): {_names(self.left)}")
        return lines


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths)


def _write_file(path: Path, data: bytes) -> None:
    """Atomic write with the permissions any new file gets here (the umask), not mkstemp's 0600."""
    atomic_write(path, data)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write(folder: Path, files: dict[str, bytes], force: bool = False) -> WriteReport:
    """Write planned files, refusing to clobber anything tensorstep did not write.

    Files of an earlier manifest that the plan no longer holds are removed only when their
    bytes are still those tensorstep wrote; anything else stays where it is.
    """
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / MANIFEST
    old = read_manifest(folder)
    owned = _owned_files(old)
    if not force:
        if manifest_path.exists() and old is None:
            raise OverwriteError(f"{manifest_path} exists and was not written by tensorstep (use --force to replace it)")
        foreign = []
        for name in files:
            path = folder / name
            if name == MANIFEST or not path.exists():
                continue
            current = sha256(path.read_bytes())
            if current not in (owned.get(name), sha256(files[name])):  # same bytes: nothing to lose
                foreign.append(str(path))
        if foreign:
            raise OverwriteError(
                "refusing to overwrite files tensorstep did not write (or that were edited since): "
                + ", ".join(foreign) + " (use --force to overwrite)"
            )
    report = WriteReport()
    for name in files:
        path = folder / name
        if path.exists() and path.read_bytes() == files[name]:
            report.unchanged.append(path)
        else:
            _write_file(path, files[name])
            report.written.append(path)
    for name, digest in sorted(owned.items()):
        path = folder / name
        if name in files or Path(name).name != name or not path.is_file():
            continue
        if sha256(path.read_bytes()) == digest:
            path.unlink()
            report.removed.append(path)
        else:
            report.left.append(path)
    return report
