"""Generated sources kept in the kernel cache: what `tensorstep generate` and `tensorstep run` write (each
target's source of a spec's kernels), read back by a later process instead of running the generator
(SymPy, Jinja2), as the cost kinds' functions are (runtime/costs.py ``sources``).

An entry is ``generated/source-<spec name>-<part>-<target>-<hash>.json`` (runtime/cache.py
``BuildCache.kept``): the spec, target and part it is of, the text and its sha256, under a name hashed
over the spec's key, the generator's fingerprint and tensorstep's version (the sources' banner names
it). An entry that is missing, unreadable, of another spec or whose text does not match its sha256 is
generated again and rewritten; a cache that cannot be written generates in each process.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional

from ..version import __version__
from .cache import BuildCache, digest
from .fingerprint import generator_fingerprint


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def entry_name(spec: Any, target: str, part: str = "all") -> str:
    """The kept entry's name for one target's source of one part of a spec."""
    return f"source-{spec.name}-{part}-{target}-{digest(spec.key, generator_fingerprint(), __version__)[:16]}"


def kept(spec: Any, targets: tuple[str, ...], part: str = "all", cache: Optional[BuildCache] = None,
         keep: bool = True) -> dict[str, str]:
    """target → the source of ``part`` of a spec's kernels (codegen's driver ``generate(spec).source``):
    the kept text where an intact entry holds it, else generated, and kept unless ``keep`` is False."""
    cache = cache or BuildCache()
    described = json.loads(json.dumps(spec.to_dict()))  # as it reads back from JSON

    def make(target: str) -> Callable[[], dict]:
        def generated() -> dict:
            from ..codegen.driver import generate  # SymPy and Jinja2 only where nothing is kept
            from ..codegen.render import keep_templates

            keep_templates(cache.root / "templates")
            text = generate(spec, targets=(target,), parts=(part,)).source(target, part)
            return {"spec": described, "target": target, "part": part, "sha256": _sha256(text), "source": text}

        return generated

    def valid(target: str) -> Callable[[dict], bool]:
        def check(found: dict) -> bool:
            text = found.get("source")
            return ((found.get("spec"), found.get("target"), found.get("part")) == (described, target, part)
                    and isinstance(text, str) and found.get("sha256") == _sha256(text))

        return check

    if keep:
        return {t: cache.kept(entry_name(spec, t, part), make(t), valid(t))["source"] for t in targets}
    return {t: (cache.found(entry_name(spec, t, part), valid(t)) or make(t)())["source"] for t in targets}


def source(spec: Any, target: str = "c") -> str:
    """The generated source text ('c', 'cuda' or 'header') of a spec (or a dict of its fields): the text
    the kernel cache keeps where an intact entry holds it (``kept``: what `tensorstep generate` and
    `run` wrote; neither SymPy nor PyTorch is imported then), else the generator's, not kept (a
    process that changes the generator's settings, as tests do, reads what it generates)."""
    from ..codegen.spec import as_spec
    from ..codegen.targets import target as target_of

    spec = as_spec(spec, "source")
    target_of(target)  # a name that is no target is refused before it names a cache entry
    return kept(spec, (target,), keep=False)[target]
