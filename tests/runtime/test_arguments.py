"""The argument table drives every argument's handling, and the layering it allows.

* A new argument is one row: a dummy optional argument added to a copy of the step table (and
  nothing else) appears in the generated signature, is checked by the Python path and by the
  native node with the same words, and does not change the results.
* vmap of an indexed step gives the same values and gradients in eager mode, under
  torch.compile and as a Python loop (one rule serves both).
* The command line's code-only commands never import PyTorch.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import ClassVar

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.codegen import arguments, builders, schemes
from tensorstep.codegen.arguments import OPTIONAL, Argument

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _dummy_table(spec) -> arguments.ArgumentTable:
    """The step's table plus one optional, non-differentiable [B, D] argument before dt."""
    table = arguments.step_table(spec)
    extra = Argument("w0", "w0", "start", ("B", "D"), presence=OPTIONAL, nullable=True, differentiable=False,
                     meaning="a dummy")
    return dataclasses.replace(table, family="dummy", inputs=table.inputs[:-1] + (extra, table.inputs[-1]))


@dataclasses.dataclass(frozen=True)
class DummySpec(ts.KernelSpec):
    """A step spec whose kernels take the dummy table (own name and key: own cache entries)."""

    family: ClassVar[str] = "dummy"

    @property
    def name(self) -> str:
        return super().name.replace("ts_", "tsdummy_", 1)

    @property
    def key(self) -> str:
        return "dummy" + super().key


@pytest.fixture
def dummy_family(monkeypatch):
    monkeypatch.setitem(arguments.FAMILIES, "dummy", _dummy_table)
    builders.register(DummySpec)(schemes.build_operator)
    return DummySpec(horizon=6, dof=2, dtype="float64")


def _inputs(B: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((B, 5, 2), (B, 2), (B, 2), (B, 2))]


def test_a_new_argument_is_one_table_row(dummy_family):
    spec = dummy_family
    assert "const double* restrict w0" in ts.source(spec, "c")  # the signature follows the table
    plain = ts.load(ts.KernelSpec(horizon=6, dof=2, dtype="float64"))
    u, p0, v0, a0 = _inputs()
    expected = plain(u, p0, v0, a0, 0.1)
    errors = {}
    for path in ("native", "python"):
        step = ts.load(spec)
        if path == "python":
            step.native = None
        elif step.native is None:
            pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
        for w0 in (None, torch.zeros(3, 2, dtype=torch.float64)):
            got = step(u, p0, v0, a0, 0.1, w0=w0)
            assert all(torch.equal(g, e) for g, e in zip(got, expected))
        with pytest.raises(ValueError) as shape_error:
            step(u, p0, v0, a0, 0.1, w0=torch.zeros(3, 3, dtype=torch.float64))
        with pytest.raises(TypeError) as dtype_error:
            step(u, p0, v0, a0, 0.1, w0=torch.zeros(3, 2, dtype=torch.float32))
        errors[path] = (str(shape_error.value), str(dtype_error.value))
    assert errors["native"] == errors["python"] == (
        "w0: expected shape (3, 2), got shape (3, 3)",
        "w0: expected dtype torch.float64 (the kernel's dtype), got torch.float32")


def test_an_unknown_argument_is_named(dummy_family):
    step = ts.load(ts.KernelSpec(horizon=6, dof=2, dtype="float64"))
    with pytest.raises(TypeError, match="w0: this kernel takes no argument of that name"):
        step(*_inputs(), 0.1, w0=torch.zeros(3, 2, dtype=torch.float64))


def test_the_same_table_gives_the_native_and_python_errors():
    """Every structural refusal, on both paths, in the same words."""
    spec = ts.KernelSpec(horizon=6, dof=2, dtype="float64", start_index=True)
    u, p0, v0, a0 = _inputs()
    idx = torch.tensor([0, 2, 1])
    calls = {
        "missing index": lambda s: s(u, p0, v0, a0, 0.1),
        "rank": lambda s: s(u[0], p0, v0, a0, 0.1, start_index=idx),
        "shape": lambda s: s(u, p0, v0[:, :1], a0, 0.1, start_index=idx),
        "dtype": lambda s: s(u.float(), p0, v0, a0, 0.1, start_index=idx),
        "index dtype": lambda s: s(u, p0, v0, a0, 0.1, start_index=idx.double()),
        "index shape": lambda s: s(u, p0, v0, a0, 0.1, start_index=idx[:2]),
        "sparse": lambda s: s(u, p0.to_sparse(), v0, a0, 0.1, start_index=idx),
        "meta": lambda s: s(u, p0, v0, a0.to("meta"), 0.1, start_index=idx),
        "empty table": lambda s: s(u, p0[:0], v0[:0], a0[:0], 0.1, start_index=idx),
        "empty batch": lambda s: s(u[:0], p0, v0, a0, 0.1, start_index=idx[:0]),
        "range": lambda s: s(u, p0, v0, a0, 0.1, start_index=torch.tensor([0, 3, 1])),
    }
    native, python = ts.load(spec), ts.load(spec)
    if native.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    python.native = None
    for case, call in calls.items():
        seen = []
        for step in (native, python):
            with pytest.raises((TypeError, ValueError, IndexError)) as err:
                call(step)
            seen.append((type(err.value), str(err.value)))
        assert seen[0] == seen[1], case


@pytest.mark.parametrize("tables_vmapped", [False, True])
def test_vmap_with_start_index_eager_compiled_and_loop(tables_vmapped):
    spec = ts.KernelSpec(horizon=7, dof=2, dtype="float64", start_index=True)
    step = ts.load(spec)
    gen = torch.Generator().manual_seed(3)
    V, B, S = 3, 4, 5
    rows = (V, S, 2) if tables_vmapped else (S, 2)
    u = torch.randn(V, B, 6, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    p0, v0, a0 = (torch.randn(*rows, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    idx = torch.randint(0, S, (V, B), generator=gen)
    w = [torch.randn(B, 7, 2, generator=gen, dtype=torch.float64) for _ in range(4)]
    dims = (0, 0, 0, 0, 0) if tables_vmapped else (0, None, None, None, 0)

    def cost(u, p0, v0, a0, idx):
        return sum((y * wk).sum() for y, wk in zip(step(u, p0, v0, a0, 0.1, start_index=idx), w))

    def loop(u, p0, v0, a0, idx):
        pick = (lambda t, v: t[v]) if tables_vmapped else (lambda t, v: t)
        return torch.stack([cost(u[v], pick(p0, v), pick(v0, v), pick(a0, v), idx[v]) for v in range(V)])

    batched = lambda *args: torch.vmap(cost, in_dims=dims)(*args)  # noqa: E731
    args = (u, p0, v0, a0, idx)
    results = {}
    for mode, fn in (("loop", loop), ("eager", batched), ("compiled", torch.compile(batched, fullgraph=True))):
        values = fn(*args)
        grads = torch.autograd.grad(values.square().sum(), (u, p0, v0, a0))
        results[mode] = [values.detach().numpy()] + [g.numpy() for g in grads]
    for mode in ("eager", "compiled"):
        for got, want in zip(results[mode], results["loop"]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("command", [
    ["show", "--horizon", "8", "--dof", "2"],
    ["stencil"],
    ["--help"],
    ["list", str(ROOT / "generated" / "franka_panda")],
    ["generate", str(ROOT / "examples" / "ur5e.yml"), "-o", "{tmp}"],
])
def test_code_only_commands_do_not_import_torch(command, tmp_path):
    command = [c.replace("{tmp}", str(tmp_path / "out")) for c in command]
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "tensorstep", *command],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported
    assert any(name.startswith("tensorstep") for name in imported)  # the probe itself works


def test_import_tensorstep_is_light():
    code = "import sys, tensorstep; print('torch' in sys.modules, 'sympy' in sys.modules, 'jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False"]
