"""A fingerprint of the generator's own files, so cached kernels follow codegen changes."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def generator_fingerprint() -> str:
    """sha256 over codegen/*.py and templates/*.j2 (contents, sorted by name)."""
    h = hashlib.sha256()
    for folder, pattern in (("codegen", "*.py"), ("templates", "*.j2")):
        for path in sorted((_ROOT / folder).glob(pattern)):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]
