"""Shared by every folder: a temporary kernel cache for the whole session. No PyTorch here.

tests/codegen runs without PyTorch (tests/codegen/test_torch_free.py checks it), so this conftest
imports neither torch nor tensorstep.runtime; the folders whose tests run kernels through PyTorch
take its fixtures from tests/torch_fixtures.py in their own conftest.py. The helpers and references
beside this file are importable from every folder (pytest.ini puts tests/ on sys.path).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Never build into the user's real ~/.cache/tensorstep: unless a cache is given (as .ci/run
# does), this session (and the subprocesses it starts) use a temporary one, removed at exit.
if not os.environ.get("TENSORSTEP_CACHE_DIR"):
    _SESSION_CACHE = tempfile.mkdtemp(prefix="tensorstep-test-cache-")
    os.environ["TENSORSTEP_CACHE_DIR"] = _SESSION_CACHE
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
# Nor the native autograd node into the per-user folder shared by every cache: unless one is
# given, the session's node goes into its kernel cache folder (a temporary one, or CI's).
if not os.environ.get("TENSORSTEP_NATIVE_DIR"):
    os.environ["TENSORSTEP_NATIVE_DIR"] = os.path.join(os.environ["TENSORSTEP_CACHE_DIR"], "native")
