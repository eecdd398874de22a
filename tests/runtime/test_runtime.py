"""Runtime: cache, cached loads without SymPy/Jinja2, input errors, unused outputs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorstep as ts
from tensorstep.runtime import launch

SPEC = ts.KernelSpec(horizon=6, dof=2, dtype="float64")


def run_python(code: str, cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=cache)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)


def test_second_process_loads_from_cache_without_codegen(tmp_path):
    code = """
        import sys, time, tensorstep as ts
        spec = ts.KernelSpec(horizon=6, dof=2, dtype="float64")
        t = time.perf_counter(); ts.load(spec); dt = time.perf_counter() - t
        print("sympy" in sys.modules, "jinja2" in sys.modules)
    """
    first = run_python(code, str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["True", "True"]  # cold: generated
    second = run_python(code, str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["False", "False"]  # warm: no code generation at all
    assert list((tmp_path / "builds").iterdir()), "artefacts live under TENSORSTEP_CACHE_DIR"


def test_each_dt_library_is_built_when_first_needed(tmp_path):
    """A dt gradient builds the reverse-mode dt kernels only; the forward-mode ones (a tangent in
    dt, which most programs never take) are built on their own first use."""
    code = """
        import torch, tensorstep as ts
        from torch.autograd import forward_ad as fwAD
        from tensorstep.runtime.cache import BuildCache
        spec = ts.KernelSpec(horizon=6, dof=2, dtype="float64", dt="per_step")
        step = ts.load(spec)
        u = torch.randn(2, 5, 2, dtype=torch.float64, requires_grad=True); z = torch.zeros(2, 2, dtype=torch.float64)
        dt = torch.full((6,), 0.1, dtype=torch.float64, requires_grad=True)
        def built():
            return sorted(p.stem.rsplit("-", 1)[0].rsplit("-", 1)[-1] for p in (BuildCache().root / "index").iterdir())
        step(u, z, z, z, dt.detach())[1].sum().backward()
        print(*built())
        step(u, z, z, z, dt)[1].sum().backward()
        print(*built())
        with fwAD.dual_level():
            fwAD.unpack_dual(step(u.detach(), z, z, z, fwAD.make_dual(dt.detach(), torch.ones(6, dtype=torch.float64)))[1])
        print(*built())
    """
    run = run_python(code, str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["core", "core dt_vjp", "core dt_jvp dt_vjp"]


def test_corrupt_cached_library_is_rebuilt(tmp_path):
    code = """
        import torch, tensorstep as ts
        spec = ts.KernelSpec(horizon=6, dof=2, dtype="float64")
        step = ts.load(spec)
        u = torch.ones(1, 5, 2, dtype=torch.float64); z = torch.zeros(1, 2, dtype=torch.float64)
        print(float(step(u, z, z, z, 0.1)[0].sum()))
    """
    assert run_python(code, str(tmp_path)).returncode == 0
    for lib in (tmp_path / "builds").glob("*/kernel.so"):
        lib.write_bytes(lib.read_bytes()[:100])  # truncate
    again = run_python(code, str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert float(again.stdout) == 10.0


def inputs(B=2, dtype=torch.float64):
    u = torch.randn(B, 5, 2, dtype=dtype)
    s = [torch.randn(B, 2, dtype=dtype) for _ in range(3)]
    return u, s


@pytest.mark.parametrize(
    "mutate, error, fragment",
    [
        (lambda u, s: (u[:, :4], s), ValueError, "u: expected shape (2, 5, 2)"),
        (lambda u, s: (u[0], s), ValueError, "u: expected 3 dims"),
        (lambda u, s: (u.float(), s), TypeError, "u: expected dtype torch.float64"),
        (lambda u, s: (u, [s[0][:1], s[1], s[2]]), ValueError, "p0: expected shape (2, 2)"),
        (lambda u, s: (u[:0], s), ValueError, "batch size is 0"),
    ],
)
def test_bad_inputs_raise_named_errors(mutate, error, fragment):
    step = ts.load(SPEC)
    u, s = mutate(*inputs())
    with pytest.raises(error) as err:
        step(u, *s, 0.1)
    assert fragment in str(err.value)


@pytest.mark.parametrize("dt", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_dt_raises(dt):
    step = ts.load(SPEC)
    u, s = inputs()
    with pytest.raises(ValueError, match="dt: expected"):
        step(u, *s, dt)
    with pytest.raises(ValueError, match="dt: expected"):
        step(u, *s, torch.tensor(dt, dtype=torch.float64))


def test_start_index_out_of_range_raises():
    spec = SPEC.replace(start_index=True)
    step = ts.load(spec)
    u, s = inputs()
    for bad in ([0, 2], [-1, 0]):
        with pytest.raises(IndexError, match="start_index: entry"):
            step(u, *s, 0.1, start_index=torch.tensor(bad))


def test_unused_outputs_are_not_materialised(monkeypatch):
    seen = []
    original = launch.Launcher.adjoint

    def spy(self, grads, *args, **kwargs):
        seen.append([g is None for g in grads])
        return original(self, grads, *args, **kwargs)

    monkeypatch.setattr(launch.Launcher, "adjoint", spy)
    step = ts.load(SPEC)
    step.native = None  # the Python path, where the launcher can be observed (the native node: test_native)
    u, s = inputs()
    u.requires_grad_(True)
    P, V, A, J = step(u, *s, 0.1)
    (P.sum() + A.sum()).backward()
    assert seen == [[False, True, False, True]]
    assert u.grad is not None


def test_second_derivative_through_dt_raises_not_silent():
    step = ts.load(SPEC)
    u, s = inputs()
    u.requires_grad_(True)
    dt = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    P, V, A, J = step(u, *s, dt)
    (gdt,) = torch.autograd.grad(J.square().sum(), dt, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives with respect to dt"):
        gdt.backward()


def test_step_pickles_and_deepcopies_by_spec():
    import copy
    import pickle

    step = ts.load(SPEC)
    u, s = inputs()
    expected = step(u, *s, 0.1)
    for clone in (copy.deepcopy(step), pickle.loads(pickle.dumps(step))):
        assert clone.spec == step.spec and clone is not step
        for a, b in zip(clone(u, *s, 0.1), expected):
            assert torch.equal(a, b)


def test_the_suite_never_builds_into_the_users_cache():
    """conftest.py gives the session a temporary cache unless one is set (as .ci/run does)."""
    from pathlib import Path

    from tensorstep.runtime.cache import cache_root

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    assert os.environ.get("TENSORSTEP_CACHE_DIR")
    assert cache_root().resolve() != (Path(base) / "tensorstep").resolve()


def test_a_library_compiles_as_a_unit_per_entry_point(tmp_path, monkeypatch):
    """On more than one core the runtime compiles each entry point as a translation unit of its
    own (-DTS_UNIT=i, side by side), and dt_jvp's long coefficient program as another, and links
    them: each unit defines its entry point (or that program) alone, and the library they make
    exports every entry point and nothing else of the spec's."""
    import ctypes
    import shutil

    from tensorstep.codegen import abi
    from tensorstep.codegen.driver import generate
    from tensorstep.runtime import cbackend

    spec = ts.KernelSpec(horizon=12, dof=2, dt="per_step")
    src = tmp_path / "kernels.c"
    src.write_text(generate(spec, targets=("c",), parts=("all",)).source("c", "all"))
    assert abi.units("all") == (*abi.PARTS["all"], "coefficients_jvp")
    for i, unit in enumerate(abi.units("all"), 1):
        obj = tmp_path / f"unit{i}.o"
        subprocess.run([cbackend.compiler(), *cbackend.c_flags(), f"-DTS_UNIT={i}", "-c", "-x", "c", str(src), "-o",
                        str(obj)], check=True)
        listed = subprocess.run([shutil.which("nm"), "-g", "--defined-only", str(obj)], capture_output=True, text=True,
                                check=True).stdout
        defined = {line.split()[-1] for line in listed.splitlines() if line.split()[-1].startswith(spec.name)}
        assert defined == {f"{spec.name}_{unit}"} | ({abi.symbol(spec.name, "n_coefficients")} if i == 1 else set())
    monkeypatch.setattr(cbackend, "cores", lambda: 2)
    cbackend.library_build("all")(src, tmp_path / "kernels.so")
    library = ctypes.CDLL(str(tmp_path / "kernels.so"))
    assert all(hasattr(library, abi.symbol(spec.name, k)) for k in abi.PARTS["all"])
    assert not hasattr(library, f"{spec.name}_coefficients_jvp")


def test_each_unit_reads_only_the_programs_it_runs(tmp_path):
    """A wide per-step stencil's tapes are tens of thousands of initializers each: a unit sees
    (after the preprocessor) only the tapes and row loops of the programs its entry point runs."""
    from tensorstep.codegen import abi
    from tensorstep.codegen.driver import generate
    from tensorstep.runtime import cbackend

    spec = ts.KernelSpec(horizon=24, dof=2, dt="per_step", difference="backward", accuracy=6, order=4)
    src = tmp_path / "kernels.c"
    src.write_text(generate(spec, targets=("c",), parts=("all",)).source("c", "all"))
    fills = {"forward", "adjoint", "dt_vjp"}
    runs = {"tape_value": fills, "coefficients_rows": fills, "tape_reverse": {"dt_vjp_finish"},
            "dt_vjp_finish_rows": {"dt_vjp_finish"}, "tape_tangent": {"coefficients_jvp"}}
    for i, unit in enumerate(abi.units("all"), 1):
        seen = subprocess.run([cbackend.compiler(), *cbackend.c_flags(), f"-DTS_UNIT={i}", "-E", "-x", "c", str(src)],
                              capture_output=True, text=True, check=True).stdout
        assert {what for what in runs if f"{spec.name}_{what}" in seen} == {w for w, users in runs.items() if unit in users}
