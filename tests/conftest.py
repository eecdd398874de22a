"""Shared fixtures: the variant grid; a temporary kernel cache for the whole session."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

import tensorstep as ts
from helpers import GRID, grid_id, make_spec
from tensorstep.runtime import native

# A load here waits for the native autograd node (built in the background for users), so each
# test sees one autograd path throughout; tests/test_native.py checks the background build.
native.BACKGROUND = False

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


@pytest.fixture(params=GRID, ids=[grid_id(g) for g in GRID])
def spec(request) -> ts.KernelSpec:
    return make_spec(request.param)


@pytest.fixture(params=["native", "python"])
def autograd_path(request):
    """Run a test through the native autograd node and through the Python Functions."""

    def use(step):
        if request.param == "python":
            step.native = None
        elif step.native is None:
            pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
        return step

    return use
