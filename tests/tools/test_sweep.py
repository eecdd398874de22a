"""tests/sweep.py: a seeded sample is the same in every process and keeps the cases' order; the full
sweep's switch gives every case."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sweep

TESTS = Path(__file__).resolve().parents[1]
DRAW = "import sweep; print(sweep.sample(range(20), 5, seed=3))"


def test_a_sample_is_k_cases_in_their_order_and_the_same_in_another_process():
    drawn = sweep.sample(range(20), 5, seed=3)
    assert len(set(drawn)) == 5 and drawn == sorted(drawn)
    other = subprocess.run([sys.executable, "-c", DRAW], cwd=TESTS, capture_output=True, text=True,
                           env={"PYTHONPATH": str(TESTS), "PYTHONHASHSEED": "7"}, check=True)
    assert other.stdout.strip() == str(drawn)
    assert sweep.sample(range(20), 5, seed=4) != drawn


def test_the_full_sweep_gives_every_case(monkeypatch):
    assert sweep.sample("abc", 5, seed=1) == ["a", "b", "c"]
    monkeypatch.setattr(sweep, "FULL", True)
    assert sweep.sample(range(20), 5, seed=3) == list(range(20))
    full = subprocess.run([sys.executable, "-c", DRAW], cwd=TESTS, capture_output=True, text=True,
                          env={"PYTHONPATH": str(TESTS), "TENSORSTEP_FULL_SWEEP": "1"}, check=True)
    assert full.stdout.strip() == str(list(range(20)))
