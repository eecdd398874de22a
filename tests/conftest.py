"""Shared fixtures: the variant grid."""
from __future__ import annotations

import pytest

import tensorstep as ts
from helpers import GRID, grid_id, make_spec


@pytest.fixture(params=GRID, ids=[grid_id(g) for g in GRID])
def spec(request) -> ts.KernelSpec:
    return make_spec(request.param)


