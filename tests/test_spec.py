"""KernelSpec: fields, validation messages, identity."""
from __future__ import annotations

import re

import pytest

import tensorstep as ts


def test_defaults_and_round_trip():
    spec = ts.KernelSpec(horizon=32, dof=7)
    assert spec.accuracy == (4, 4, 2)
    assert ts.KernelSpec.from_dict(spec.to_dict()) == spec
    assert hash(spec) == hash(ts.KernelSpec.from_dict(spec.to_dict()))
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", spec.name)
    assert spec.name != ts.KernelSpec(horizon=32, dof=7, dtype="float64").name


def test_backward_default_accuracy_and_int_accuracy():
    assert ts.KernelSpec(horizon=8, dof=1, difference="backward").accuracy == (1, 1, 1)
    assert ts.KernelSpec(horizon=8, dof=1, difference="backward", accuracy=2).accuracy == (2, 2, 2)
    assert ts.KernelSpec(horizon=8, dof=1, order=4).accuracy == (4, 4, 2, 2)


def test_immutable():
    spec = ts.KernelSpec(horizon=8, dof=1)
    with pytest.raises(Exception):
        spec.horizon = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("horizon", 1, "horizon=1"),
        ("horizon", "32", "horizon='32'"),
        ("dof", 0, "dof=0"),
        ("control", "torque", "allowed: 'position', 'velocity', 'acceleration', 'jerk'"),
        ("difference", "forward", "allowed: 'backward', 'central'"),
        ("accuracy", 3, "central differences need even accuracies"),
        ("accuracy", (2, 2), "tuple of 3 ints"),
        ("accuracy", 0, "each accuracy must be in"),
        ("integrator", "rk4", "allowed: 'semi_implicit_euler', 'exact'"),
        ("end", "wrap", "allowed: 'hold', 'one_sided'"),
        ("dt", "adaptive", "allowed: 'uniform', 'per_step'"),
        ("start_index", 1, "expected True or False"),
        ("layout", "hbd", "allowed: 'bhd', 'bdh'"),
        ("dtype", "float16", "allowed: 'float32', 'float64'"),
        ("order", 5, "allowed: 3"),
    ],
)
def test_invalid_fields_name_field_value_and_allowed(field, value, fragment):
    with pytest.raises(ValueError) as err:
        ts.KernelSpec(**{"horizon": 8, "dof": 2, field: value})
    message = str(err.value)
    assert f"KernelSpec.{field}=" in message
    assert fragment in message


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown KernelSpec field"):
        ts.KernelSpec.from_dict({"horizon": 8, "dof": 2, "robot": "x"})
