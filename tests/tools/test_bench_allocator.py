"""`tensorstep bench` keeps freed memory in its process, so that no method's outputs are
page-faulted in on some runs and not on others."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tensorstep.cli import main

CALLS = """
import resource, sys, torch
from tensorstep.bench import allocator
print(allocator.keep_freed_memory())

def call():  # four 6 MB outputs, about the B-spline case's at B=4000, freed together
    outs = [torch.empty(6 << 18).fill_(1.0) for _ in range(4)]
    del outs

for _ in range(10):
    call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    call()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")


@glibc_only
def test_fixed_thresholds_keep_freed_outputs_in_the_process():
    """With glibc's defaults these calls page-fault all 6144 pages of their outputs in on every
    call in some processes and not in others (it depends on what the heap holds); with the bench's
    thresholds, in none. (The heap may still grow now and then, by one output's 1536 pages.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    run = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    line, faults = run.stdout.splitlines()
    assert line.startswith("malloc: freed memory kept in the process") and "32 MiB" in line
    assert float(faults) < 1000


@glibc_only
def test_bench_says_which_malloc_settings_it_ran_with():
    args = ["bench", "--scheme", "backward", "--batch", "1", "--no-codegen", "--budget", "0.01", "--no-inductor"]
    system = CliRunner().invoke(main, [*args, "--system-malloc"])
    assert system.exit_code == 0, system.output
    assert system.output.startswith("malloc: glibc's defaults")


@pytest.mark.parametrize("libc", [("musl", ""), ("", "")])
def test_off_glibc_neither_line_claims_glibc(monkeypatch, libc):
    """Off glibc (musl, or a C library platform cannot name) the bench leaves malloc alone and
    says so, with and without --system-malloc."""
    from tensorstep.bench import allocator

    monkeypatch.setattr(platform, "libc_ver", lambda *args, **kwargs: libc)
    assert allocator.keep_freed_memory() == allocator.leave_as_is() == "malloc: not glibc; left as it is"
