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


ALLOWED_FIELDS = ("horizon, dof, control, difference, accuracy, integrator, end, dt, start_index, layout, dtype, "
                  "order, goal_index, degree, knots, steps, costs, outputs")


@pytest.mark.parametrize("typo, closest", [("diference", "difference"), ("horizn", "horizon"),
                                           ("stpes", "steps"), ("robot", None)])
def test_a_misspelt_keyword_names_the_closest_field_and_the_allowed_ones(typo, closest):
    """As a config's unknown keys do: the closest field (where one is close) and every field."""
    hint = f"did you mean '{closest}'? " if closest else ""
    with pytest.raises(TypeError) as err:
        ts.KernelSpec(horizon=8, dof=2, **{typo: "central"})
    assert str(err.value) == f"KernelSpec() got an unexpected keyword argument '{typo}' ({hint}allowed: {ALLOWED_FIELDS})"
    with pytest.raises(ValueError) as err:
        ts.KernelSpec.from_dict({"horizon": 8, "dof": 2, typo: "central"})
    assert str(err.value) == f"unknown KernelSpec field '{typo}' ({hint}allowed: {ALLOWED_FIELDS})"
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}'"):
        ts.KernelSpec(horizon=8, dof=2).replace(**{typo: 1})


# ---- PyTorch and NumPy conventions: integers and dtypes as the libraries spell them ----------------

def test_numpy_integers_are_plain_ints_in_the_spec():
    np = pytest.importorskip("numpy")
    spec = ts.KernelSpec(horizon=np.int64(32), dof=np.int32(7), accuracy=(np.int64(2), 2, 2), order=np.int64(3))
    plain = ts.KernelSpec(horizon=32, dof=7, accuracy=2)
    assert spec == plain and hash(spec) == hash(plain)
    assert (spec.name, spec.key) == (plain.name, plain.key)
    assert all(type(v) is int for v in (spec.horizon, spec.dof, spec.order, *spec.accuracy))
    assert ts.KernelSpec(horizon=8, dof=1, accuracy=np.int16(2)).accuracy == (2, 2, 2)


def test_numpy_bools_and_floats_are_still_refused():
    np = pytest.importorskip("numpy")
    for field, value in (("horizon", np.float64(8.0)), ("dof", np.bool_(True)), ("order", True)):
        with pytest.raises(ValueError, match=f"KernelSpec.{field}="):
            ts.KernelSpec(**{"horizon": 8, "dof": 2, field: value})


def test_torch_dtypes_are_accepted_and_stored_as_names():
    torch = pytest.importorskip("torch")
    for dtype, name in ((torch.float32, "float32"), (torch.float64, "float64")):
        spec = ts.KernelSpec(horizon=8, dof=2, dtype=dtype)
        assert spec.dtype == name and spec == ts.KernelSpec(horizon=8, dof=2, dtype=name)
        assert spec.key == ts.KernelSpec(horizon=8, dof=2, dtype=name).key
    assert ts.KernelSpec(horizon=8, dof=2).replace(dtype=torch.float64).dtype == "float64"
    with pytest.raises(ValueError, match=r"KernelSpec.dtype=torch.float16 is invalid: allowed: 'float32', 'float64'"):
        ts.KernelSpec(horizon=8, dof=2, dtype=torch.float16)


# ---- fields a control does not use are refused unless left at their defaults -----------------------

@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(control="position", integrator="exact"),
         "KernelSpec.integrator='exact' means nothing for control='position' "
         "(it applies to velocity/acceleration/jerk control)"),
        (dict(control="acceleration", difference="backward"),
         "KernelSpec.difference='backward' means nothing for control='acceleration' (it applies to position control)"),
        (dict(control="velocity", end="one_sided"),
         "KernelSpec.end='one_sided' means nothing for control='velocity' (it applies to position/bspline control)"),
        (dict(control="jerk", accuracy=2),
         "KernelSpec.accuracy=(2, 2, 2) means nothing for control='jerk' (it applies to position control)"),
    ],
)
def test_fields_that_mean_nothing_for_the_control_are_refused(fields, message):
    with pytest.raises(ValueError) as err:
        ts.KernelSpec(horizon=8, dof=2, **fields)
    assert message in str(err.value)


def test_unused_fields_at_their_defaults_are_accepted():
    # manifests and to_dict() carry every field; the defaults must round-trip for every control
    for control in ("position", "velocity", "acceleration", "jerk"):
        for order in (3, 4):
            spec = ts.KernelSpec(horizon=8, dof=2, control=control, order=order)
            assert ts.KernelSpec.from_dict(spec.to_dict()) == spec
    explicit = ts.KernelSpec(horizon=8, dof=2, control="acceleration", difference="central", accuracy=(4, 4, 2),
                             end="hold", integrator="exact")
    assert explicit.integrator == "exact"
    assert ts.KernelSpec(horizon=8, dof=2, integrator="semi_implicit_euler").control == "position"


def test_curobo_v2_spec_dicts_name_their_type_and_earlier_ones_still_load():
    """A cuRobo v2 spec's dict tags its type "spec" (the argument table keeps "family" for kernel
    families); manifests written with the earlier "family" tag load to the same spec."""
    from tensorstep.codegen.curobo_v2_spec import CuroboV2Spec
    from tensorstep.codegen.spec import spec_from_dict

    spec = CuroboV2Spec(kind="bspline", horizon=24, dof=3, degree=4, knots=6, steps=2)
    data = spec.to_dict()
    assert data["spec"] == "curobo_v2" and "family" not in data
    earlier = {"family": "curobo_v2", **{k: v for k, v in data.items() if k != "spec"}}
    assert spec_from_dict(data) == spec_from_dict(earlier) == spec
