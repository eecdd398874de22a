"""tests/codegen runs without PyTorch: none of its modules imports torch, directly or through a
conftest, a helper or the tensorstep modules it uses.

A fresh interpreter in which importing torch fails collects this folder, which imports every test
module here and every conftest.py that pytest loads for them; one import of torch fails the
collection, and pytest's report names the module and the line.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

_COLLECT_WITHOUT_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"{name} is imported while collecting tests/codegen")

sys.meta_path.insert(0, NoTorch())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def test_codegen_tests_collect_with_torch_unimportable():
    run = subprocess.run([sys.executable, "-c", _COLLECT_WITHOUT_TORCH, str(HERE)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    collected = set(re.findall(r"^(?:codegen/)?(test_\w+\.py)::", run.stdout, re.MULTILINE))
    assert collected == {p.name for p in HERE.glob("test_*.py")}, run.stdout[-4000:]


def test_the_check_fails_on_a_module_that_imports_torch(tmp_path):
    (tmp_path / "test_uses_torch.py").write_text("import torch\n\ndef test_nothing():\n    pass\n")
    run = subprocess.run([sys.executable, "-c", _COLLECT_WITHOUT_TORCH, str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "torch is imported while collecting tests/codegen" in run.stdout + run.stderr
