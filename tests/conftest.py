"""Shared fixtures: the variant grid."""
from __future__ import annotations

import pytest

import tensorstep as ts
from helpers import GRID, grid_id, make_spec


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
