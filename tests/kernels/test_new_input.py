"""A new input is a table row and a builder: nothing in codegen/, templates/ or runtime/ changes.

This file defines a kernel family the package does not ship, a step whose actions carry a
per-trajectory offset, ``u_eff[b, j, d] = u[b, j, d] + bias[b, d]`` (a feed-forward term an
optimiser learns along with the actions), in two parts:

* the argument table's new row: ``bias``, [B, D], differentiable (``_biased_table``);
* its meaning in a builder: every reference to an action also reads the offset with the same
  coefficient (``_biased_operator``).

The family is then generated for C and CUDA, compiled (C through cffi; the CUDA source run on
the host, and to PTX where nvcc is present), and checked against the NumPy reference with the
offset applied to the actions, gradients included, by float64 gradcheck and gradgradcheck,
and by an adjoint dot test.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import ClassVar

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen import arguments, builders
from tensorstep.codegen.arguments import Argument
from tensorstep.codegen.operator import Row, combine, is_action, reads

import reference
from cuda_on_host import host_step
from helpers import check_ptx, gradcheck64, gradgradcheck64

BIAS = ("bias", 0)  # the operator's reference to the new input: (argument, row)


def _biased_table(spec) -> arguments.ArgumentTable:
    """The step's table plus the offset, a [B, D] input with a gradient, before dt."""
    table = arguments.step_table(spec)
    bias = Argument("bias", "bias", "offset", ("B", "D"), meaning="per-trajectory action offset")
    return dataclasses.replace(table, family="biased", inputs=table.inputs[:-1] + (bias, table.inputs[-1]))


def _biased_operator(spec):
    """The plain step's operator with every action reference c·u_j also reading c·bias."""
    op = builders.build_operator(spec.plain)
    rows = [Row(r.k, r.h, combine([*r.terms, *((c, BIAS) for c, ref in r.terms if is_action(ref))]))
            for r in op.rows]
    return dataclasses.replace(op, rows=rows, inputs=reads(_biased_table(spec)))


@dataclasses.dataclass(frozen=True)
class BiasedSpec(ts.KernelSpec):
    """A step spec of the biased family (its own name and key: its own cache entries)."""

    family: ClassVar[str] = "biased"

    @property
    def plain(self) -> ts.KernelSpec:
        return ts.KernelSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ts.KernelSpec)})

    @property
    def name(self) -> str:
        return super().name.replace("ts_", "tsbias_", 1)

    @property
    def key(self) -> str:
        return "biased" + super().key


@pytest.fixture(autouse=True)
def biased_family(monkeypatch):
    monkeypatch.setitem(arguments.FAMILIES, "biased", _biased_table)
    builders.register(BiasedSpec)(_biased_operator)


SPECS = {
    "stencil": dict(horizon=7, dof=2, dtype="float64"),
    "recurrence": dict(horizon=7, dof=2, dtype="float64", control="jerk", integrator="exact"),
    "goal": dict(horizon=8, dof=2, dtype="float64", end="goal"),
    "indexed": dict(horizon=7, dof=2, dtype="float64", start_index=True, layout="bdh"),
}


def _inputs(spec, B: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    S = B + 1 if spec.start_index else B
    x = {"u": rand(B, spec.n_actions, spec.dof), "p0": rand(S, spec.dof), "v0": rand(S, spec.dof),
         "a0": rand(S, spec.dof), "j0": rand(S, spec.dof), "bias": rand(B, spec.dof)}
    if spec.start_index:
        x["start_index"] = torch.tensor([2, 0, 3][:B])
    if spec.end == "goal":
        x.update(gp=rand(B, spec.dof), gv=rand(B, spec.dof), ga=rand(B, spec.dof), gj=rand(B, spec.dof))
    return x


def _call(step, spec, x: dict, dt: float = 0.1):
    u = x["u"].transpose(1, 2) if spec.layout == "bdh" else x["u"]
    goal = {"goal": (x["gp"], x["gv"], x["ga"], x["gj"])} if spec.end == "goal" else {}
    index = {"start_index": x["start_index"]} if spec.start_index else {}
    ys = step(u, x["p0"], x["v0"], x["a0"], dt, j0=x["j0"], bias=x["bias"], **index, **goal)
    return [y.transpose(1, 2) for y in ys] if spec.layout == "bdh" else list(ys)


def _expected(spec, x: dict, dt: float = 0.1) -> np.ndarray:
    """The reference's outputs [K, B, H, D] for actions u + bias (a NumPy loop over columns)."""
    rows = x["start_index"].numpy() if spec.start_index else np.arange(x["u"].shape[0])
    u = (x["u"] + x["bias"][:, None, :]).numpy()
    start = np.stack([x[n].numpy()[rows] for n in ("p0", "v0", "a0", "j0")], axis=1)
    goal = np.stack([x[n].numpy() for n in ("gp", "gv", "ga", "gj")], axis=1) if spec.end == "goal" else None
    B, _, D = u.shape
    out = np.zeros((spec.order + 1, B, spec.horizon, D))
    for b in range(B):
        for d in range(D):
            out[:, b, :, d] = reference.column(spec.plain, u[b, :, d], start[b, :, d], dt,
                                               None if goal is None else goal[b, :, d])
    return out


def _steps(spec) -> dict:
    """The family's kernels on each path: C (Python autograd and, where built, the native node),
    and the CUDA source run on the host."""
    python = ts.load(spec)
    native = ts.load(spec)
    python.native = None
    steps = {"c": python, "cuda_on_host": host_step(spec)}
    if native.native is not None:
        steps["c_native"] = native
    return steps


@pytest.mark.parametrize("case", SPECS)
def test_values_and_gradients_match_the_reference(case):
    spec = BiasedSpec(**SPECS[case])
    assert "const double* restrict bias" in ts.source(spec, "c")  # the signature follows the table
    x = _inputs(spec)
    expected = _expected(spec, x)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # d(Σ w·Y)/d bias[b] = Σ_j d(Σ w·Y)/d u_eff[b, j]: the reference's transpose, summed over the action rows
    M_u, _ = reference.matrices(spec.plain, 0.1)
    expected_bias = np.einsum("khn,kbhd->bd", M_u, weights.numpy())
    for path, step in _steps(spec).items():
        leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in x.items()}
        ys = _call(step, spec, leaves)
        np.testing.assert_allclose(np.stack([y.detach().numpy() for y in ys]), expected, rtol=1e-12, atol=1e-12,
                                   err_msg=path)
        sum(torch.sum(w * y) for w, y in zip(weights, ys)).backward()
        np.testing.assert_allclose(leaves["bias"].grad.numpy(), expected_bias, rtol=1e-11, atol=1e-11, err_msg=path)


@pytest.mark.parametrize("case", ["stencil", "recurrence", "indexed"])
def test_gradcheck_and_adjoint_dot_test(case):
    spec = BiasedSpec(**SPECS[case])
    x = _inputs(spec, B=2)
    names = ["u", "p0", "bias"]
    step = ts.load(spec)

    def f(u, p0, bias):
        return tuple(_call(step, spec, {**x, "u": u, "p0": p0, "bias": bias}))

    inputs = [x[n].clone().requires_grad_() for n in names]
    assert gradcheck64(f, inputs, check_forward_ad=True)
    assert gradgradcheck64(f, inputs)
    # adjoint dot test: <J v, w> = <v, Jᵀ w> with the kernels' forward and adjoint
    gen = torch.Generator().manual_seed(2)
    v = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in inputs]
    _, Jv = torch.func.jvp(f, tuple(t.detach() for t in inputs), tuple(v))
    w = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in Jv]
    _, vjp = torch.func.vjp(f, *(t.detach() for t in inputs))
    JTw = vjp(tuple(w))
    lhs = sum(torch.sum(a * b) for a, b in zip(Jv, w))
    rhs = sum(torch.sum(a * b) for a, b in zip(v, JTw))
    assert abs(float(lhs - rhs)) <= 1e-12 * max(1.0, abs(float(lhs)))


def test_cuda_source_compiles_to_ptx(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    spec = BiasedSpec(**{**SPECS["goal"], "dtype": "float32"})
    source = ts.source(spec, "cuda")
    assert "GIN_BIAS" in source  # the offset's gradient store, defined from its table row
    check_ptx([source], tmp_path)


@pytest.mark.parametrize("case", ["stencil", "indexed"])
def test_check_verifies_the_new_input(case):
    """`tensorstep check`'s verification reads every input from the argument table: the offset is
    given random values and its dense matrix comes from the operator, so a wrong kernel fails."""
    from tensorstep.runtime.verify import verify_launcher

    spec = BiasedSpec(**SPECS[case])
    result = verify_launcher(spec, ts.load(spec).launcher, torch.device("cpu"))
    assert result["ok"] and result["forward"] < 1e-13 and result["adjoint"] < 1e-13, result
    # kernels whose offset enters twice, checked against the family's operator
    wrong = _DoubledSpec(**SPECS[case])
    assert not verify_launcher(spec, ts.load(wrong).launcher, torch.device("cpu"))["ok"]


@dataclasses.dataclass(frozen=True)
class _DoubledSpec(BiasedSpec):
    """The biased family with a wrong builder (the offset counted twice): kernels check must refuse."""

    @property
    def name(self) -> str:
        return super().name.replace("tsbias_", "tsbias2_", 1)

    @property
    def key(self) -> str:
        return "doubled" + super().key


@builders.register(_DoubledSpec)
def _doubled_operator(spec):
    op = _biased_operator(spec)
    rows = [Row(r.k, r.h, tuple((2 * c if ref == BIAS else c, ref) for c, ref in r.terms)) for r in op.rows]
    return dataclasses.replace(op, rows=rows)


def test_operator_matrices_name_the_new_input():
    """ts.operator_matrices gives the offset's matrix by its name: the actions' summed over their rows."""
    spec = BiasedSpec(**SPECS["stencil"])
    M = ts.operator_matrices(spec, 0.1)
    M_u, _ = reference.matrices(spec.plain, 0.1)
    np.testing.assert_allclose(M["bias"][:, :, 0], M_u.sum(axis=2), rtol=1e-13, atol=1e-13)
