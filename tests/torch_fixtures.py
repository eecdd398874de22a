"""Fixtures of the folders whose tests run kernels through PyTorch (each folder's conftest.py
imports them; tests/codegen does not): the variant grid and the two autograd paths."""
from __future__ import annotations

import pytest

import tensorstep as ts
from helpers import GRID, grid_id, make_spec
from tensorstep.runtime import native

# A load here waits for the native autograd node (built in the background for users), so each
# test sees one autograd path throughout; tests/runtime/test_native.py checks the background build.
native.BACKGROUND = False


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
