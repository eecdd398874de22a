"""Reliability: bad input never reaches a kernel, configs never reach source, the cache heals."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
import tensorstep as ts
from helpers import scale_close
from tensorstep.cli import main

# ---- runtime input errors, in processes of their own (a crash would fail the tests) ----------------
# One process per kernel (plain, indexed, per-step dt) calls it once for each of its cases, each from fresh
# inputs; a case's test reads its own line of that process's output.

SETUP = """
import json, torch, tensorstep as ts
spec = ts.KernelSpec(horizon=6, dof=2, dtype="float64", start_index={indexed}, dt="{dt_mode}")
step = ts.load(spec)
"""
CASE = """
def case():
    B = 2
    u = torch.randn(B, 5, 2, dtype=torch.float64)
    p0 = torch.zeros(B + 1 if spec.start_index else B, 2, dtype=torch.float64); v0 = p0.clone(); a0 = p0.clone()
    dt = 0.1 if spec.dt == "uniform" else torch.full((6,), 0.1, dtype=torch.float64)
    kw = {{"start_index": torch.tensor([0, 2])}} if spec.start_index else {{}}
    {mutation}
    try:
        step(u, p0, v0, a0, dt, **kw)
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
    return "NO ERROR"
print(json.dumps([{name!r}, case()]), flush=True)
"""

ERROR_CASES = {
    "shape": ("u = u[:, :4].contiguous()", "ValueError: u: expected shape (2, 5, 2), got shape (2, 4, 2)"),
    "rank": ("u = u[0]", "ValueError: u: expected 3 dims"),
    "dtype": ("u = u.float()", "TypeError: u: expected dtype torch.float64 (the kernel's dtype), got torch.float32"),
    "device": ("u = u.to('meta')", "ValueError: u: expected device cpu (the kernel's device), got meta"),
    "sparse layout": ("u = u.to_sparse()", "TypeError: u: expected a dense (strided) tensor, got layout torch.sparse_coo"),
    "bdh data to a bhd kernel": ("u = torch.randn(B, 2, 5, dtype=torch.float64)", "ValueError: u: expected shape (2, 5, 2), got shape (2, 2, 5)"),
    "mixed devices": ("v0 = v0.to('meta')", "ValueError: v0: expected device cpu (the kernel's device), got meta"),
    "start shape": ("a0 = a0[:1]", "ValueError: a0: expected shape (2, 2), got shape (1, 2)"),
    "j0 shape": ("kw['j0'] = torch.zeros(3, dtype=torch.float64)", "ValueError: j0: expected 2 dims"),
    "batch zero": ("u = u[:0]", "ValueError: u: batch size is 0"),
    "dt nan": ("dt = float('nan')", "ValueError: dt: expected finite, positive step durations, got nan"),
    "dt inf tensor": ("dt = torch.tensor(float('inf'), dtype=torch.float64)", "ValueError: dt: expected finite, positive step durations"),
    "dt zero": ("dt = 0.0", "ValueError: dt: expected finite, positive step durations, got 0.0"),
    "dt negative": ("dt = -0.1", "ValueError: dt: expected finite, positive step durations, got -0.1"),
    "dt wrong shape": ("dt = torch.full((3,), 0.1, dtype=torch.float64)", "ValueError: dt: expected a scalar"),
    "start_index given to a plain kernel": ("kw['start_index'] = torch.tensor([0, 1])", "TypeError: start_index: this kernel takes no start_index argument (its spec does not set start_index=True)"),
}
INDEXED_CASES = {
    "index out of range": ("kw['start_index'] = torch.tensor([0, 3])", "IndexError: start_index: entry 3 is out of range"),
    "index negative": ("kw['start_index'] = torch.tensor([-1, 0])", "IndexError: start_index: entry -1 is out of range"),
    "index dtype": ("kw['start_index'] = torch.tensor([0.0, 1.0])", "TypeError: start_index: expected dtype torch.int32 or torch.int64"),
    "index shape": ("kw['start_index'] = torch.tensor([0, 1, 2])", "ValueError: start_index: expected shape (2,), got shape (3,)"),
    "index missing": ("kw = {}", "TypeError: start_index: this kernel needs a start_index argument (start_index=True), got None"),
}
PER_STEP_CASES = {"per-step dt given as scalar": ("dt = 0.1", "ValueError: dt: this kernel takes per-step durations, a tensor of shape (6,)")}
#: (indexed, dt mode): the cases of each kernel
KERNELS = {(False, "uniform"): {**ERROR_CASES, "valid call": ("pass", "NO ERROR")}, (True, "uniform"): INDEXED_CASES, (False, "per_step"): PER_STEP_CASES}


def _run_cases(indexed: bool, dt_mode: str, cases: dict) -> subprocess.CompletedProcess:
    code = SETUP.format(indexed=indexed, dt_mode=dt_mode) + "".join(
        CASE.format(name=name, mutation=mutation) for name, (mutation, _) in cases.items())
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def bad_input_runs() -> dict:
    """Each kernel's process: its exit status, stderr and each case's outcome by name."""
    runs = {}
    for (indexed, dt_mode), cases in KERNELS.items():
        proc = _run_cases(indexed, dt_mode, cases)
        outcomes = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
        runs[indexed, dt_mode] = (proc.returncode, proc.stderr, outcomes)
    return runs


ALL_CASES = [(name, expected, kernel) for kernel, cases in KERNELS.items() for name, (_, expected) in cases.items()
             if name != "valid call"]


@pytest.mark.parametrize("name, expected, kernel", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_bad_input_raises_clear_error_in_subprocess(bad_input_runs, name, expected, kernel):
    returncode, stderr, outcomes = bad_input_runs[kernel]
    assert returncode == 0, f"process crashed ({returncode}): {stderr[-2000:]}"
    assert expected in outcomes[name], outcomes[name]


def test_valid_call_in_subprocess_runs(bad_input_runs):
    returncode, stderr, outcomes = bad_input_runs[False, "uniform"]
    assert returncode == 0 and outcomes["valid call"] == "NO ERROR", (outcomes, stderr[-2000:])


# ---- hostile configs: nothing but validated numbers and derived identifiers reaches source --------

HOSTILE = ['x"; system("rm -rf /"); //', "a\nb", "*/ #include <stdlib.h> /*", "$(reboot) `id` | & ;",
           "#include </etc/passwd>", "\\\\\"'\\n", "名前"]


def test_hostile_names_never_reach_generated_source(tmp_path):
    config = {"robot": HOSTILE[0] + HOSTILE[2], "joints": HOSTILE, "dt": 0.02,
              "kernels": [{"horizon": 8, "name": HOSTILE[3]}, {"horizon": 8, "control": "jerk", "name": HOSTILE[4]}]}
    path = tmp_path / "hostile.yml"
    path.write_text(json.dumps(config))  # JSON is valid YAML
    result = CliRunner().invoke(main, ["generate", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    sources = [p for p in (tmp_path / "out").iterdir() if p.suffix in (".c", ".cu", ".h")]
    assert len(sources) == 6
    for p in sources:
        text = p.read_text()
        for bad in HOSTILE + ["rm -rf", "reboot", "passwd", "stdlib"]:
            assert bad not in text, (p.name, bad)
        assert text.isascii()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["robot"] == config["robot"] and manifest["joints"] == HOSTILE  # kept as data, exactly


@pytest.mark.parametrize(
    "kernel, fragment",
    [
        ({"horizon": 10**12}, "KernelSpec.horizon=1000000000000"),
        ({"horizon": float("nan")}, "KernelSpec.horizon=nan"),
        ({"horizon": "32; rm -rf /"}, "KernelSpec.horizon='32; rm -rf /'"),
        ({"horizon": 8, "accuracy": "*/"}, "KernelSpec.accuracy='*/'"),
        ({"horizon": 8, "control": "position\"); system(\"id"}, "KernelSpec.control="),
        ({"horizon": 8, "dof": 3}, "disagrees with the robot's 2 joints"),
        ({"horizon": 8, "layout": "#include"}, "KernelSpec.layout='#include'"),
        ({"horizon": 8, "evil": "x"}, "unknown KernelSpec field"),
    ],
)
def test_hostile_values_are_rejected_with_key_path(tmp_path, kernel, fragment):
    path = tmp_path / "robot.yml"
    path.write_text(json.dumps({"robot": "r", "joints": ["a", "b"], "kernels": [kernel]}).replace("NaN", ".nan"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["generate", str(path), "-o", str(out)])
    assert result.exit_code != 0
    assert "kernels[0]" in result.output and fragment in result.output and "Traceback" not in result.output
    assert not out.exists()  # nothing written


def test_non_finite_dt_in_config_rejected(tmp_path):
    path = tmp_path / "robot.yml"
    path.write_text("robot: r\ndof: 2\ndt: .nan\nkernels: [{horizon: 8}]\n")
    result = CliRunner().invoke(main, ["generate", str(path), "-o", str(tmp_path / "o")])
    assert result.exit_code != 0 and "dt: expected a finite, positive number" in result.output


# ---- cache faults -----------------------------------------------------------------------------------

LOAD = """
import sys, tensorstep as ts, torch
step = ts.load(ts.KernelSpec(horizon=7, dof=3, dtype="float64"))
u = torch.ones(1, 6, 3, dtype=torch.float64); z = torch.zeros(1, 3, dtype=torch.float64)
print("sum", float(step(u, z, z, z, 0.1)[0].sum()))
"""


def _cc_wrapper(tmp_path: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/compilations\nsleep 1\nexec {gcc} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def test_concurrent_processes_build_once(tmp_path):
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(tmp_path / "cache"), CC=str(_cc_wrapper(tmp_path)))
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        assert "sum 18.0" in out
    # one library made (a compiler run that writes a .so: the single compile, or the link of the units)
    commands = (tmp_path / "compilations").read_text().splitlines()
    assert sum(bool(re.search(r"-o \S+\.so$", c)) for c in commands) == 1, commands


COUNTED = """
import jinja2
from pathlib import Path
from tensorstep.codegen import render
render.PACKAGE_KEPT = Path({package_kept!r})  # beside the templates: a test's folder
compiled = []
compile_ = jinja2.Environment.compile
jinja2.Environment.compile = lambda self, source, name=None, filename=None, *a, **k: (
    compiled.append(name), compile_(self, source, name, filename, *a, **k))[1]
""" + LOAD.replace("float64", "{dtype}") + """
print("compiled", *sorted(set(compiled)))
"""


def _compiled(cache: Path, package_kept: Path) -> str:
    """What a new process that loads LOAD's spec compiles of the templates (the kernel cache ``cache``)."""
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(cache))
    code = COUNTED.format(dtype="float64", package_kept=str(package_kept))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "sum 18.0" in run.stdout
    return next(line for line in run.stdout.splitlines() if line.startswith("compiled"))


def test_templates_compiled_once_beside_them_serve_a_new_kernel_cache(tmp_path):
    kept = tmp_path / "templates-pycache"
    assert "kernel.c.j2" in _compiled(tmp_path / "cache1", kept).split()  # compiled, then kept beside them
    assert any(kept.iterdir())
    assert _compiled(tmp_path / "cache2", kept) == "compiled"  # a new kernel cache: none compiled
    assert not (tmp_path / "cache1" / "templates").exists() and not (tmp_path / "cache2" / "templates").exists()


def test_a_process_that_generates_reuses_the_templates_an_earlier_one_compiled(tmp_path):
    # where nothing can be kept beside the templates (below a file), the kernel cache keeps them
    (tmp_path / "a-file").write_text("")
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(tmp_path))
    unwritable = str(tmp_path / "a-file" / "__pycache__")
    runs = []
    for dtype in ("float64", "float32", "float64"):  # the second: another spec, generated in a new process
        if dtype == "float64" and runs:  # the third: kept templates damaged, another spec
            for kept in (tmp_path / "templates").iterdir():
                kept.write_bytes(kept.read_bytes()[:40])
            code = COUNTED.format(dtype="float64", package_kept=unwritable).replace(
                "horizon=7", "horizon=7, difference='backward'")
        else:
            code = COUNTED.format(dtype=dtype, package_kept=unwritable)
        runs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300))
        assert runs[-1].returncode == 0, runs[-1].stderr
        assert "sum 18.0" in runs[-1].stdout
    compiled = [next(line for line in r.stdout.splitlines() if line.startswith("compiled")) for r in runs]
    assert "kernel.c.j2" in compiled[0].split()  # compiled, then kept
    assert compiled[1] == "compiled"  # none compiled: every template the generator renders was kept
    assert "kernel.c.j2" in compiled[2].split()  # damaged: compiled again


def test_unusable_cache_folder_falls_back_with_warning(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(blocker / "cache"))
    proc = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "sum 18.0" in proc.stdout
    assert "using a temporary kernel cache" in proc.stderr


def test_missing_compiler_says_what_to_install(tmp_path):
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(tmp_path), CC="/nonexistent/bin/cc")
    proc = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "no C compiler found" in proc.stderr and "apt-get install gcc" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_unavailable_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cuda"):
        ts.load(ts.KernelSpec(horizon=6, dof=2), "cuda")


def test_corrupt_ffi_module_is_rebuilt(tmp_path):
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(tmp_path))
    assert subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True).returncode == 0
    for module in tmp_path.glob("builds/*/ffi_*.py"):
        module.write_text("this is not python (")
    again = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "sum 18.0" in again.stdout, again.stderr


# ---- property-based: random valid specs against the reference, random invalid specs ---------------

valid_specs = st.builds(
    dict,
    horizon=st.integers(2, 9),
    dof=st.integers(1, 3),
    control=st.sampled_from(["position", "velocity", "acceleration", "jerk"]),
    difference=st.sampled_from(["backward", "central"]),
    integrator=st.sampled_from(["semi_implicit_euler", "exact"]),
    end=st.sampled_from(["hold", "one_sided"]),
    dt=st.sampled_from(["uniform", "per_step"]),
    start_index=st.booleans(),
    layout=st.sampled_from(["bhd", "bdh"]),
    order=st.sampled_from([3, 4]),
    accuracy_seed=st.integers(1, 3),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=valid_specs, batch=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_random_valid_specs_match_reference(fields, batch, seed):
    a = fields.pop("accuracy_seed")
    fields["accuracy"] = 2 * a if fields["difference"] == "central" else a
    # each control takes only its own fields (the others are refused unless left at their defaults)
    unused = ("integrator",) if fields["control"] == "position" else ("difference", "accuracy", "end")
    for name in unused:
        del fields[name]
    spec = ts.KernelSpec(dtype="float64", **fields)
    gen = torch.Generator().manual_seed(seed)
    S = batch + 1 if spec.start_index else batch
    u = torch.randn(batch, spec.n_actions, spec.dof, generator=gen, dtype=torch.float64)
    starts = [torch.randn(S, spec.dof, generator=gen, dtype=torch.float64) for _ in range(4)]
    idx = torch.randint(0, S, (batch,), generator=gen)
    dt = 0.1 if spec.dt == "uniform" else 0.05 + 0.1 * torch.rand(spec.horizon, generator=gen, dtype=torch.float64)
    step = ts.load(spec)
    kw = {"j0": starts[3]}
    if spec.start_index:
        kw["start_index"] = idx
    u_in = u if spec.layout == "bhd" else u.transpose(1, 2).contiguous()
    outs = step(u_in, *starts[:3], dt, **kw)
    s = torch.stack(starts, 1).numpy()
    s = s[idx.numpy()] if spec.start_index else s
    expected = reference.apply(spec, dt if isinstance(dt, float) else dt.tolist(), u.numpy(), s)
    for k, y in enumerate(outs):
        y = y.numpy() if spec.layout == "bhd" else y.transpose(1, 2).numpy()
        scale_close(y, expected[k], 1e-11)


invalid_fields = st.one_of(
    st.tuples(st.just("horizon"), st.one_of(st.integers(max_value=1), st.integers(min_value=4097), st.floats(), st.text())),
    st.tuples(st.just("dof"), st.one_of(st.integers(max_value=0), st.integers(min_value=4097), st.none())),
    st.tuples(st.just("control"), st.text().filter(lambda s: s not in ("position", "velocity", "acceleration", "jerk"))),
    st.tuples(st.just("difference"), st.text().filter(lambda s: s not in ("backward", "central"))),
    st.tuples(st.just("accuracy"), st.one_of(st.integers(max_value=0), st.integers(min_value=9), st.text(min_size=1))),
    st.tuples(st.just("end"), st.text().filter(lambda s: s not in ("hold", "one_sided"))),
    st.tuples(st.just("dt"), st.text().filter(lambda s: s not in ("uniform", "per_step"))),
    st.tuples(st.just("layout"), st.text().filter(lambda s: s not in ("bhd", "bdh"))),
    st.tuples(st.just("dtype"), st.text().filter(lambda s: s not in ("float32", "float64"))),
    st.tuples(st.just("order"), st.integers().filter(lambda n: n not in (3, 4))),
    st.tuples(st.just("start_index"), st.one_of(st.integers(), st.text())),
)


@settings(max_examples=200, deadline=None)
@given(bad=invalid_fields)
def test_random_invalid_specs_raise_value_error_naming_the_field(bad):
    field, value = bad
    with pytest.raises(ValueError) as err:
        ts.KernelSpec(**{"horizon": 8, "dof": 2, field: value})
    assert f"KernelSpec.{field}=" in str(err.value)
