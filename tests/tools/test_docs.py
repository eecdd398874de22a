"""The documentation's examples run: every docs/*.md as a doctest, its YAML configs load.

Like Devito's docs, the pages are executable: an example that no longer matches the
kernels fails here. docs/lbfgs_float32.py, the experiment behind docs/numerics.md, is
checked on one case so its advice (float64, or float32 on displacements) stays true.
"""
from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: pages that record measurements: their code blocks are the commands and scripts of their day,
#: kept as they were run, not examples of today's API
RECORDS = {"benchmarks-history.md"}


def test_pages_exist():
    names = {p.name for p in PAGES}
    assert {"index.md", "semantics.md", "kernelspec.md", "cli.md", "compat_curobo.md", "numerics.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_examples_run(page: Path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # examples must not depend on, or write to, the working directory
    text = page.read_text()
    has_code = "```" in text
    result = doctest.testfile(str(page), module_relative=False, optionflags=FLAGS, report=True, verbose=False)
    assert result.failed == 0, f"{page.name}: {result.failed} of {result.attempted} examples failed (see the output above)"
    if has_code and page.name not in RECORDS:
        assert result.attempted >= 1, f"{page.name} has code but no runnable >>> example"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_yaml_configs_load(page: Path, tmp_path):
    from tensorstep.config import load_config

    for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)):
        if "kernels:" in block:
            path = tmp_path / f"{page.stem}_{i}.yml"
            path.write_text(block)
            assert load_config(path).specs


def test_docs_cite_no_design_files():
    """Users never see the developers' design files, so the docs must say things themselves."""
    for page in PAGES:
        assert not re.search(r"\bSPEC\b|\bCOMPAT\b|SPEC\.md|COMPAT\.md", page.read_text()), page.name


def test_lbfgs_experiment_one_case():
    spec = importlib.util.spec_from_file_location("lbfgs_float32", DOCS / "lbfgs_float32.py")
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    weights = (0.0, 1e-3, 1e-2)  # the case where raw float32 stalls far above the optimum
    assert experiment.excess(weights, "float64", shift=False) < 1e-8
    assert experiment.excess(weights, "float32", shift=True) < 1e-3


def _modules_with_examples() -> list[str]:
    """The package's modules whose docstrings hold >>> examples (docs/ and tests/ aside)."""
    root = Path(__file__).resolve().parents[2]
    return sorted("tensorstep." + ".".join(p.relative_to(root).with_suffix("").parts)
                  for p in root.rglob("*.py")
                  if p.relative_to(root).parts[0] not in {"tests", "docs", "generated", "build"}
                  and not any(part.startswith(".") for part in p.relative_to(root).parts)
                  and ">>>" in p.read_text())


@pytest.mark.parametrize("module", _modules_with_examples())
def test_docstring_examples_run(module: str):
    """Docstring examples in the code run too (doctest), as the pages' do."""
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=FLAGS, report=True, verbose=False)
    assert result.failed == 0 and result.attempted >= 1, f"{module}: {result.failed} of {result.attempted} failed"
