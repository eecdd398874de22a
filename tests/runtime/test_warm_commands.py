"""`tensorstep run` and `tensorstep generate` with a warm kernel cache: the sources they write are the ones
the cache kept (runtime/sources.py), so a warm process writes the generator's bytes without running it
(no SymPy, Jinja2 or codegen's driver, lowering or renderer); a missing or damaged kept entry is made
again by the generator and kept."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tensorstep as ts
from tensorstep.codegen import emit
from tensorstep.config import load_config

#: the modules a warm process must not import
GENERATOR = ("sympy", "jinja2", "tensorstep.codegen.driver", "tensorstep.codegen.lower", "tensorstep.codegen.render")
CONFIG = """
robot: demo_arm
joints: [a, b]
dt: 0.05
defaults: {horizon: 7, dtype: float64}
kernels:
  - {control: position, difference: central, costs: []}
  - {control: acceleration, integrator: exact, outputs: [P]}
limits:
  velocity: [3, 2]
costs:
  - {kind: bound, state: velocity, weight: 0.5, margin: 0.1}
  - {kind: squared, state: jerk, weight: 1.0e-4}
"""
# `tensorstep ARGS...` in a process of its own; its last line: the generator's modules it imported
CODE = f"""
import json, sys
from tensorstep.cli import main
main(sys.argv[1:], prog_name="tensorstep", standalone_mode=False)
print(json.dumps([m for m in {GENERATOR!r} if m in sys.modules]))
"""


def tensorstep(cache: Path, *args: str) -> list[str]:
    """Run the command line in a new process with the kernel cache ``cache``: the generator's modules it imported."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE), *args], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, TENSORSTEP_CACHE_DIR=str(cache)))
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


def folder(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "demo.yml"
    path.write_text(CONFIG)
    return path


def expected(config: Path, target: str) -> dict[str, bytes]:
    """What the generator itself writes for the config (this process's codegen, no cache)."""
    return {name: data for name, data in emit.plan(load_config(str(config), None), target).items()}


def test_a_warm_run_and_generate_write_the_generators_bytes_without_it(config, tmp_path):
    """A cold `run` generates (SymPy, Jinja2); then, in that cache, `run`, `generate` and `generate --target c`
    import none of the generator, each folder byte for byte what the generator writes."""
    ts.load(ts.KernelSpec(horizon=7, dof=2, dtype="float64")).native  # the session's node, built before the processes
    cache, out = tmp_path / "cache", tmp_path / "out"
    cold = tensorstep(cache, "run", str(config), "-o", str(out / "run-cold"), "--batch", "3")
    assert {"sympy", "jinja2", "tensorstep.codegen.driver"} <= set(cold)  # the probe sees a generating process
    assert tensorstep(cache, "run", str(config), "-o", str(out / "run-warm"), "--batch", "3") == []
    assert tensorstep(cache, "generate", str(config), "-o", str(out / "generate")) == []
    assert tensorstep(cache, "generate", str(config), "-o", str(out / "generate-c"), "--target", "c") == []
    every = expected(config, "all")
    assert len(every) == 7  # a .c, .cu and .h for each kernel, and the manifest
    for name in ("run-cold", "run-warm", "generate"):
        assert folder(out / name) == every, name
    assert folder(out / "generate-c") == expected(config, "c")


@pytest.mark.parametrize("damage", ["missing", "truncated", "text edited", "another spec's"])
def test_a_damaged_kept_source_is_generated_again(config, tmp_path, monkeypatch, damage):
    """A kept source that is missing, unreadable, whose text no longer matches its hash, or that holds
    another spec's source is made again by the generator (the process imports SymPy) and kept again;
    the files written are the generator's."""
    from click.testing import CliRunner

    from tensorstep.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("TENSORSTEP_CACHE_DIR", str(cache))
    assert CliRunner().invoke(main, ["generate", str(config), "-o", str(tmp_path / "first")]).exit_code == 0
    plain, fused = load_config(str(config), None).specs
    (kept,) = (cache / "generated").glob(f"source-{fused.name}-all-c-*.json")
    (other,) = (cache / "generated").glob(f"source-{plain.name}-all-c-*.json")
    whole = kept.read_bytes()
    if damage == "missing":
        kept.unlink()
    elif damage == "truncated":
        kept.write_bytes(whole[: len(whole) // 2])
    elif damage == "text edited":
        entry = json.loads(whole)
        kept.write_text(json.dumps({**entry, "source": entry["source"].replace("double", "float")}))
    else:
        kept.write_bytes(other.read_bytes())
    assert "sympy" in tensorstep(cache, "generate", str(config), "-o", str(tmp_path / "again"))
    assert kept.read_bytes() == whole
    assert folder(tmp_path / "again") == expected(config, "all")
    assert tensorstep(cache, "generate", str(config), "-o", str(tmp_path / "warm")) == []


# ts.source(SPEC, TARGET) in a process of its own: its text, and the generator's modules (and PyTorch) it imported
SOURCE = f"""
import json, sys
import tensorstep as ts
text = ts.source(ts.KernelSpec.from_dict(json.loads(sys.argv[1])), sys.argv[2])
print(json.dumps([text, [m for m in {GENERATOR + ("torch",)!r} if m in sys.modules]]))
"""


def test_source_and_show_read_the_kept_text(config, tmp_path, monkeypatch):
    """Where the cache keeps a spec's source (as `generate` and `run` keep it), ``ts.source`` and `tensorstep
    show` print it in a process that imports neither the generator (SymPy, Jinja2) nor PyTorch; the text
    is the generator's. Where nothing is kept, ``ts.source`` generates and keeps nothing (so a process
    that changes the generator's settings, as tests do, gets what it generates)."""
    from tensorstep.codegen.driver import generate
    from tensorstep.runtime.cache import BuildCache
    from tensorstep.runtime.sources import kept

    cache = tmp_path / "cache"
    plain, fused = load_config(str(config), None).specs
    for spec in (plain, fused):
        kept(spec, ("c",), cache=BuildCache(cache))  # what `generate --target c` keeps
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(SOURCE), json.dumps(fused.to_dict()), "c"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TENSORSTEP_CACHE_DIR=str(cache)))
    assert run.returncode == 0, run.stderr[-4000:]
    text, imported = json.loads(run.stdout.splitlines()[-1])
    assert imported == []
    assert text == generate(fused, targets=("c",)).source("c")
    shown = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE), "show", str(config)], capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, TENSORSTEP_CACHE_DIR=str(cache)))
    assert shown.returncode == 0, shown.stderr[-4000:]
    assert json.loads(shown.stdout.splitlines()[-1]) == []
    assert shown.stdout.rsplit("\n", 2)[0] == "\n".join(generate(s, targets=("c",)).source("c") for s in (plain, fused))

    monkeypatch.setenv("TENSORSTEP_CACHE_DIR", str(tmp_path / "empty"))
    assert ts.source(fused, "header") == generate(fused, targets=("header",)).source("header")
    assert not (tmp_path / "empty" / "generated").exists()
