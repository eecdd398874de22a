"""New outputs of a large batch advised to come in transparent huge pages (runtime/memory.py and
the native node's ``fresh``): which range is advised, and that the kernels' outputs get it on
both call paths, the Python launcher and the native node."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tensorstep as ts
from tensorstep.runtime import memory

MiB = 1 << 20
SPEC = ts.KernelSpec(horizon=8, dof=7, dtype="float64")


def test_the_advised_range_is_the_whole_huge_pages_inside_the_block():
    huge = 2 * MiB
    assert memory.advised_range(1 * MiB, 5 * MiB, huge) == (2 * MiB, 4 * MiB)
    assert memory.advised_range(2 * MiB, 4 * MiB, huge) == (2 * MiB, 4 * MiB)  # aligned: all of it
    assert memory.advised_range(64, 4 * MiB, huge) == (2 * MiB, 2 * MiB)  # one whole page inside
    assert memory.advised_range(64, 4 * MiB - 1, huge) is None  # under two huge pages: not advised
    assert memory.advised_range(1 * MiB, 5 * MiB, 0) is None  # no huge pages on this system


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        found = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if found:
            inside = int(found[1], 16) <= address < int(found[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def advised(t: torch.Tensor) -> bool:
    """Whether the first whole huge page of ``t`` is in a mapping advised MADV_HUGEPAGE ("hg")."""
    huge = memory.huge_page_size()
    start, _ = memory.advised_range(t.data_ptr(), t.numel() * t.element_size(), huge)
    return "hg" in vm_flags(start)


needs_huge_pages = pytest.mark.skipif(not memory.huge_page_size() or not Path("/proc/self/smaps").exists(),
                                      reason="no transparent huge pages on this system")


@needs_huge_pages
@pytest.mark.parametrize("path", ["launcher", "native"])
def test_large_outputs_and_gradients_are_advised(path):
    step = ts.load(SPEC)
    if path == "native" and step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    if path == "launcher":
        step.native = None  # the Python autograd Function and the launcher's allocations
    B = 16 * memory.huge_page_size() // (SPEC.horizon * SPEC.dof * 8)  # P of 16 huge pages
    u = torch.randn(B, SPEC.horizon - 1, SPEC.dof, dtype=torch.float64, requires_grad=True)
    starts = [torch.randn(B, SPEC.dof, dtype=torch.float64) for _ in range(3)]
    P, V, A, J = step(u, *starts, 0.1)
    assert ("NativeStep" in P.grad_fn.name()) == (path == "native")
    P.backward(torch.ones_like(P))
    assert advised(P) and advised(J) and advised(u.grad)


@needs_huge_pages
def test_the_switch_turns_the_advice_off_on_both_paths(tmp_path):
    """TENSORSTEP_HUGE_PAGES=0: no output is advised, by the launcher or by the native node."""
    import os
    import subprocess
    import sys

    script = f"""
import torch, tensorstep as ts
from tensorstep.runtime import memory, native
import test_memory as m
assert memory.huge_page_size() == 0 and memory.ADVISED_FROM == float("inf")
native.wait()
huge = {memory.huge_page_size()}
B = 16 * huge // (m.SPEC.horizon * m.SPEC.dof * 8)
for path in ("launcher", "native"):
    step = ts.load(m.SPEC)
    if path == "launcher":
        step.native = None
    elif step.native is None:
        continue
    u = torch.randn(B, m.SPEC.horizon - 1, m.SPEC.dof, dtype=torch.float64, requires_grad=True)
    P = step(u, *[torch.randn(B, m.SPEC.dof, dtype=torch.float64) for _ in range(3)], 0.1)[0]
    P.backward(torch.ones_like(P))
    for t in (P, u.grad):
        start, _ = memory.advised_range(t.data_ptr(), t.nbytes, huge)
        assert "hg" not in m.vm_flags(start), path
print("ok")
"""
    env = {**os.environ, "TENSORSTEP_HUGE_PAGES": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
