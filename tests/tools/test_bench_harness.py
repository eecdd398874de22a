"""The bench's interleaved timing: every method takes a turn in every round, and no method holds
one place in the rounds (a method's place moved its time on a CPU)."""
from __future__ import annotations

import itertools

from tensorstep.bench.harness import time_interleaved


def test_each_round_starts_one_method_further_on():
    calls: list[str] = []
    methods = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    ticks = itertools.count()
    time_interleaved(methods, "cpu", budget_s=7.0, repeats=4, clock=lambda: float(next(ticks)))
    # the warm-up (two calls each) and the one round that sizes the inner loop, then the rounds
    rounds = "".join(calls[3 * 2 + 3:])
    inner = rounds.count("a") // 4 - 1  # each turn: one untimed call and `inner` timed ones
    turns = [rounds[i] for i in range(0, len(rounds), inner + 1)]
    assert "".join(turns) == "abc" "bca" "cab" "abc"
