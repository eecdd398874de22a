"""A fused step's C forms built on demand (runtime/cbackend.py ``Forms``): a first load compiles the
entry points alone; each form, the general one too, is built, in a library of its own, on the first
call that runs it, and gives the bits of the library with every form compiled in."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tensorstep as ts
from tensorstep.codegen.driver import generate
from tensorstep.runtime.api import Step
from tensorstep.runtime.launch import CpuBackend, Launcher

TERMS = (("bound", "position"), ("bound", "velocity"), ("squared", "acceleration"))
SETUP = """
    import sys, torch, tensorstep as ts
    from tensorstep.runtime.cache import BuildCache
    H, D = 6, 2
    spec = ts.KernelSpec(horizon=H, dof=D, dtype="float64", costs={terms!r}, outputs=("P",))
    def built():  # the libraries in the cache's index: core, core-form<i>
        return sorted(p.stem.rsplit("-", 1)[0].split("-", 1)[1] for p in (BuildCache().root / "index").iterdir())
    def parameters(overlap=False, rows=False):
        g = torch.Generator().manual_seed(1)
        r = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)
        p = {{"bound_position_weight": 0.5 + r(D), "bound_velocity_weight": 0.5 + r(D), "squared_acceleration_weight": r(D),
              "bound_position_limit": torch.stack([-0.2 - r(D), 0.2 + r(D)]), "bound_velocity_margin": 0.05 * r(D),
              "bound_velocity_limit": torch.stack([-1 - r(D), 1 + r(D)]), "bound_position_margin": 0.05 * r(D)}}
        if overlap:  # one dof's margins overlap: no narrow form
            p["bound_velocity_margin"] = torch.tensor([0.01, 5.0], dtype=torch.float64)
        if rows:
            p["bound_position_row_weight"] = 0.5 + r(H)
        return p
    def call(step, **options):
        g = torch.Generator().manual_seed(0)
        u = (0.3 * torch.randn(3, H - 1, D, generator=g, dtype=torch.float64)).cumsum(1).requires_grad_()
        z = torch.zeros(3, D, dtype=torch.float64)
        P, cost = step(u, z, z, z, 0.1, **parameters(**options))
        (P.sum() + cost.sum()).backward()
        return P, cost, u.grad
    def defined_costs(states, p):  # each term from its definition, [B, T]
        terms = []
        for kind, state in spec.costs:
            y, w = states[state], p[f"{{kind}}_{{state}}_weight"]
            if kind == "bound":
                lo, hi = p[f"bound_{{state}}_limit"]
                m = p[f"bound_{{state}}_margin"]
                terms.append((w * (torch.relu(y - (hi - m)) ** 2 + torch.relu((lo + m) - y) ** 2)).sum((1, 2)))
            else:
                terms.append((w * y ** 2).sum((1, 2)))
        return torch.stack(terms, 1)
""".format(terms=TERMS)


def run_python(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(cache), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)], env=environment,
                          capture_output=True, text=True, timeout=600)


def test_a_first_load_builds_no_form_and_each_call_the_form_it_runs(tmp_path):
    code = """
        step = ts.load(spec)
        print(*built())
        call(step)  # narrow forms allowed, no row weights: form 1
        print(*built())
        call(step, rows=True)  # narrow forms allowed, row weights: form 2
        print(*built())
        call(step, overlap=True, rows=True)  # neither: the general form (form 0)
        call(step, overlap=True)  # no row weights: form 3
        print(*built())
        print("tensorstep.codegen.driver" in sys.modules)  # what generates sources (imported on a cache miss)
    """
    first = run_python(code, tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[:4] == ["core", "core core-form1", "core core-form1 core-form2",
                         "core core-form0 core-form1 core-form2 core-form3"]  # (no plain twin: runtime/api.py)
    assert lines[4] == "True"  # generated
    second = run_python(code, tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[-1] == "False", second.stdout  # every library from the cache: no codegen
    assert second.stdout.splitlines()[:4] == lines[3:4] * 4


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_forms_built_on_demand_give_the_bits_of_the_library_with_every_form(dtype):
    spec = ts.KernelSpec(horizon=7, dof=3, dtype=dtype, costs=TERMS + (("squared", "jerk"),), outputs=("P",))
    lazy = ts.load(spec)
    every = generate(spec, targets=("c",), parts=("all",))
    assert "TS_FORM ==" in every.source("c", "all")  # the source generate writes holds every form
    eager = Step(spec, torch.device("cpu"), Launcher(spec, CpuBackend(spec, every.source("c", "all"),
                                                                        dict(every.metadata))))
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.rand(*s, generator=g, dtype=tdt)  # noqa: E731
    u = (0.4 * torch.randn(*lazy.action_shape(5), generator=g, dtype=tdt)).cumsum(1)
    starts = [0.1 * torch.randn(5, 3, generator=g, dtype=tdt) for _ in range(3)]
    base = {"bound_position_weight": 0.5 + r(3), "bound_velocity_weight": 0.5 + r(3), "squared_acceleration_weight": r(3),
            "squared_jerk_weight": r(3), "bound_position_limit": torch.stack([-0.3 - r(3), 0.3 + r(3)]),
            "bound_position_margin": 0.05 * r(3), "bound_velocity_limit": torch.stack([-1 - r(3), 1 + r(3)]),
            "bound_velocity_margin": 0.05 * r(3)}
    rows = {"bound_position_row_weight": 0.5 + r(7), "squared_jerk_row_weight": 0.5 + r(7)}
    overlap = {"bound_velocity_margin": torch.tensor([0.01, 9.0, 0.02], dtype=tdt)}
    W = torch.randn(5, 7, 3, generator=g, dtype=tdt)
    for params in (base, {**base, **rows}, {**base, **overlap}, {**base, **rows, **overlap}):
        results = []
        for step in (lazy, eager, lazy):  # the first lazy call builds the form, the second finds it
            x = u.clone().requires_grad_()
            P, cost = step(x, *starts, 0.05, **params)
            torch.autograd.backward([P, cost], [W, torch.ones_like(cost)])
            results.append((P.detach(), cost.detach(), x.grad))
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert torch.equal(a, b)


def _compiler(tmp_path: Path, name: str, when: str, then: str, after: str = "") -> Path:
    """gcc behind a shell script that first runs ``then`` on the units whose command matches the
    shell pattern ``when``, then ``after`` on every one."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    wrapper = tmp_path / name
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in {when}) {then};; esac\n{after}exec {gcc} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _failing_form_compiler(tmp_path: Path, forms: str = '*"TS_FORM=1 "*') -> Path:
    """A compiler that fails on the units of the forms whose command matches ``forms`` (form 1's by
    default) and logs every library it links."""
    return _compiler(tmp_path, "cc-wrapper", forms, "echo 'error: no form today' >&2; exit 1",
                     f"echo \"$@\" >> {tmp_path}/compilations\n")


def test_a_form_that_fails_to_build_says_why_and_its_calls_run_the_general_form(tmp_path):
    code = """
        import warnings
        from tensorstep.codegen.driver import generate
        from tensorstep.runtime.api import Step
        from tensorstep.runtime.launch import CpuBackend, Launcher
        step = ts.load(spec)
        every = generate(spec, targets=("c",), parts=("all",))
        eager = Step(spec, torch.device("cpu"), Launcher(spec, CpuBackend(spec, every.source("c", "all"), dict(every.metadata))))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs = [call(step) for _ in range(2)]
        print(len(caught), str(caught and caught[0].message).replace(chr(10), " "))
        print(*built())
        expected = call(eager)  # form 1 (every form compiled in)
        print(all(torch.equal(a, b) for a, b in zip(runs[0], runs[1])),
              torch.equal(runs[0][0], expected[0]), torch.equal(runs[0][2], expected[2]),
              torch.allclose(runs[0][1], expected[1], rtol=1e-13, atol=0))
    """
    run = run_python(code, tmp_path / "cache", CC=str(_failing_form_compiler(tmp_path)))
    assert run.returncode == 0, run.stderr
    warned, libraries, same = run.stdout.splitlines()
    assert warned.startswith("1 ") and "narrow_unit_rows form of its kernels could not be built" in warned
    assert libraries == "core core-form0"  # the general form, built when the first call needed it
    assert "no form today" in warned and "run the general form" in warned
    assert same == "True True True True"  # states and gradients the same bits, the cost within rounding


def test_an_interrupted_form_build_raises_after_the_call_and_is_built_on_the_next(tmp_path):
    code = """
        import time
        from tensorstep.runtime import cbackend
        build = cbackend._artefact
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        step = ts.load(spec)
        cbackend._artefact = interrupted
        u = torch.zeros(3, H - 1, D, dtype=torch.float64); z = torch.zeros(3, D, dtype=torch.float64)
        try:
            step(u, z, z, z, 0.1, **parameters())  # no form built (not the general one either), then the interrupt
            time.sleep(10)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        cbackend._artefact = build
        call(step)
        print(*built())
    """
    run = run_python(code, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["interrupted", "core core-form1"]


def _stopped_compiler(tmp_path: Path, when: str) -> Path:
    """A compiler killed by SIGINT (as a Ctrl-C kills it: it is in the caller's process group) on the
    units whose command matches the shell pattern ``when``, while the file ``stop`` exists."""
    return _compiler(tmp_path, "cc-stopped", when, f"[ -e {tmp_path}/stop ] && kill -INT $$")


def test_a_form_build_stopped_by_a_signal_is_not_a_failed_build(tmp_path):
    # a Ctrl-C that stops the compiler before it stops Python (or a compiler killed in a thread that
    # gets no KeyboardInterrupt): that call runs the general form (built then), the next builds the form
    code = f"""
        import warnings
        from pathlib import Path
        step = ts.load(spec)
        Path({str(tmp_path / "stop")!r}).touch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = call(step)
        print(len(caught), str(caught and caught[0].message).replace(chr(10), " "))
        print(*built())
        Path({str(tmp_path / "stop")!r}).unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = call(step)
        print(len(caught), *built())
        print(torch.equal(first[0], second[0]), torch.equal(first[2], second[2]))
    """
    run = run_python(code, tmp_path / "cache", CC=str(_stopped_compiler(tmp_path, '*"TS_FORM=1 "*')))
    assert run.returncode == 0, run.stderr
    warned, before, after, same = run.stdout.splitlines()
    # the forward's and then the adjoint's first call: each tries, neither records a failure
    assert warned.startswith("2 "), warned
    assert ("the build of the narrow_unit_rows form of its kernels was stopped by SIGINT; this call runs the "
            "general form, the next one that runs that form builds it") in warned, warned
    assert before == "core core-form0"  # the general form; nothing recorded of form 1: no library, no failure
    assert after == "0 core core-form0 core-form1"  # built on the next call, without a warning
    assert same == "True True"  # states and gradients: the same bits in either form


def test_a_ctrl_c_during_a_form_build_interrupts_and_the_next_call_builds_the_form(tmp_path):
    # SIGINT to the whole process group, as a terminal's Ctrl-C or a notebook's interrupt sends it:
    # Python and the compiler both get it, in whichever order they act on it
    wrapper = _compiler(tmp_path, "cc-slow", "*TS_FORM=*",
                        f"[ -e {tmp_path}/slow ] && touch {tmp_path}/started && sleep 60")
    (tmp_path / "slow").touch()
    code = """
        import time
        step = ts.load(spec)
        try:
            call(step)
            time.sleep(1)  # (an interrupt raised again by the runtime is raised after the sleep)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        call(step)
        print(*built())
    """
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(tmp_path / "cache"), CC=str(wrapper))
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(1200):  # until the form's compiler runs
            if (tmp_path / "started").exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "started").exists(), process.communicate()
        os.killpg(process.pid, signal.SIGINT)
        (tmp_path / "slow").unlink()
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert out.splitlines() == ["interrupted", "core core-form1"], (out, err)


def test_a_library_build_stopped_by_a_signal_raises_and_the_next_load_builds_it(tmp_path):
    code = f"""
        from pathlib import Path
        from tensorstep.runtime.cbackend import BuildStopped
        Path({str(tmp_path / "stop")!r}).touch()
        try:
            ts.load(spec)
        except BuildStopped as err:
            print(type(err).__name__, err.signal, str(err).replace(chr(10), " "))
        print(*built() if (BuildCache().root / "index").exists() else ["nothing"])
        Path({str(tmp_path / "stop")!r}).unlink()
        call(ts.load(spec))
        print(*built())
    """
    run = run_python(code, tmp_path / "cache", CC=str(_stopped_compiler(tmp_path, "*")))
    assert run.returncode == 0, run.stderr
    raised, before, after = run.stdout.splitlines()
    assert raised.startswith("BuildStopped SIGINT the C compiler was stopped by SIGINT while it built "), raised
    assert raised.endswith("; the next use builds it again")
    assert before == "nothing" and after == "core core-form1"


def test_concurrent_processes_build_a_form_once(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/compilations\nsleep 1\nexec {gcc} \"$@\"\n")
    wrapper.chmod(0o755)
    code = """
        P, cost, g = call(ts.load(spec))
        print(float(cost.sum()))
    """
    env = dict(os.environ, TENSORSTEP_NATIVE="0", TENSORSTEP_CACHE_DIR=str(tmp_path / "cache"), CC=str(wrapper))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    assert outputs[0][0] == outputs[1][0]
    commands = (tmp_path / "compilations").read_text().splitlines()
    links = [c for c in commands if re.search(r"-o \S+\.so$", c)]
    # the fused core's entry points and the one form the call ran (no plain twin: runtime/api.py), each linked once
    assert len(links) == 2, links


def test_a_fresh_cache_first_call_builds_its_own_form_alone_and_gets_the_definitions_values(tmp_path):
    # the reference: the plain step (every state, no costs) and each term from its definition, float64
    code = """
        import numpy as np
        step = ts.load(spec)
        P, cost, grad = call(step)  # narrow forms allowed, no row weights: form 1
        print(*built())
        plain = ts.load(spec.replace(costs=(), outputs=None))
        g = torch.Generator().manual_seed(0)
        u = (0.3 * torch.randn(3, H - 1, D, generator=g, dtype=torch.float64)).cumsum(1).requires_grad_()
        z = torch.zeros(3, D, dtype=torch.float64)
        states = dict(zip(("position", "velocity", "acceleration", "jerk"), plain(u, z, z, z, 0.1)))
        reference = defined_costs(states, parameters())
        (states["position"].sum() + reference.sum()).backward()
        close = lambda a, b: np.allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12, atol=1e-12)
        print(close(P, states["position"]), close(cost, reference), close(grad, u.grad))
    """
    run = run_python(code, tmp_path)
    assert run.returncode == 0, run.stderr
    libraries, same = run.stdout.splitlines()
    assert libraries == "core core-form1"  # the entry points and the call's form: no general form (form 0)
    assert same == "True True True"


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_call_whose_form_and_the_general_form_cannot_be_built_raises(tmp_path, native):
    # native "1": the native node's op runs the forward where the node is built (else the Python path)
    code = """
        import warnings
        from tensorstep.runtime import native
        native.BACKGROUND = False
        step = ts.load(spec)
        u = torch.zeros(3, H - 1, D, dtype=torch.float64); z = torch.zeros(3, D, dtype=torch.float64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # the second call builds nothing (both failures recorded) and raises too
                try:
                    step(u, z, z, z, 0.1, **parameters())
                    print("no error")
                except RuntimeError as err:
                    print(str(err).replace(chr(10), " "))
        for w in caught:
            print(str(w.message).replace(chr(10), " "))
        print(*built())
    """
    env = dict(os.environ, TENSORSTEP_NATIVE=native, TENSORSTEP_CACHE_DIR=str(tmp_path / "cache"),
               CC=str(_failing_form_compiler(tmp_path, "*TS_FORM=*")))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    *raised, libraries = run.stdout.splitlines()
    errors, warned = raised[:2], raised[2:]
    for error in errors:
        assert error.startswith("tensorstep: no form of the forward kernel of ts_"), error
        assert error.split(" (", 1)[1].startswith("its narrow_unit_rows form, then the general one) could be built, "
                                                  "so this call wrote no output (CompileError: "), error
        assert "no form today" in error
    assert len(warned) == 2, warned  # the first call's: its form, then the general one
    assert "narrow_unit_rows form of its kernels could not be built" in warned[0] and "no form today" in warned[0]
    assert "general form of its kernels could not be built" in warned[1]
    assert warned[1].endswith("this call writes no output and raises")
    assert libraries == "core"


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_backward_whose_adjoint_forms_cannot_be_built_raises_and_leaves_no_record(tmp_path, native):
    # native "1": the backward runs in the native node's autograd node (else the Python Function's)
    code = """
        import warnings
        import numpy as np
        from tensorstep.runtime import cbackend, native, unbuilt
        native.BACKGROUND = False
        find = cbackend.Forms.find
        def failing(self, form, symbol):  # every form fails to build for the adjoint alone
            if symbol.startswith(spec.name + "_adjoint"):
                raise cbackend.CompileError(["cc"], f"form{form}.c", "error: no adjoint form today")
            return find(self, form, symbol)
        cbackend.Forms.find = failing
        step = ts.load(spec)
        print(step.native is not None)
        g = torch.Generator().manual_seed(0)
        u = (0.3 * torch.randn(3, H - 1, D, generator=g, dtype=torch.float64)).cumsum(1).requires_grad_()
        z = torch.zeros(3, D, dtype=torch.float64)
        p = parameters()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            P, cost = step(u, z, z, z, 0.1, **p)  # the forward's form builds
            try:
                (P.sum() + cost.sum()).backward()
                print("no error")
            except RuntimeError as err:
                print(str(err).replace(chr(10), " "))
        print(u.grad is None, len(unbuilt.UNBUILT))
        # the thread's next kernel call raises nothing of that backward's
        plain = ts.load(spec.replace(costs=(), outputs=None))
        x = u.detach().clone().requires_grad_()
        plain(x, z, z, z, 0.1)[0].sum().backward()
        print("next call ran")
        # double backward runs the composite form (the plain step and the terms in PyTorch), never the
        # fused adjoint: its gradient, and the Hessian-vector product through it, against the definitions
        def reference(x):
            states = dict(zip(("position", "velocity", "acceleration", "jerk"), plain(x, z, z, z, 0.1)))
            return states["position"].sum() + defined_costs(states, p).sum()
        def fused(x):
            P, cost = step(x, z, z, z, 0.1, **p)
            return P.sum() + cost.sum()
        v = torch.randn(u.shape, generator=g, dtype=torch.float64)
        results = []
        for f in (fused, reference):
            x = u.detach().clone().requires_grad_()
            (grad,) = torch.autograd.grad(f(x), x, create_graph=True)
            (hvp,) = torch.autograd.grad((grad * v).sum(), x)
            results.append((grad.detach().numpy(), hvp.numpy()))
        print(all(np.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(*results)))
    """
    env = dict(os.environ, TENSORSTEP_NATIVE=native, TENSORSTEP_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    on_node, error, after, next_call, double = run.stdout.splitlines()
    assert on_node == str(native == "1")
    assert error.startswith("tensorstep: no form of the adjoint kernel of ts_"), error
    assert error.split(" (", 1)[1].startswith("its narrow_unit_rows form, then the general one) could be built, "
                                              "so this call wrote no output (CompileError: "), error
    assert "no adjoint form today" in error, error
    assert after == "True 0"  # no gradient written, no record left
    assert next_call == "next call ran"
    assert double == "True"
