"""`tensorstep bench --profile`: torch.profiler over the costs bench's methods, a table per method."""
from __future__ import annotations

import re
from types import SimpleNamespace

from click.testing import CliRunner

from tensorstep.bench import profile
from tensorstep.bench.costs import CostCase
from tensorstep.cli import main


def test_the_table_is_per_call_and_ranked_by_self_time():
    events = [SimpleNamespace(key="a", count=40, self_cpu_time_total=100.0, self_device_time_total=900.0),
              SimpleNamespace(key="b|c", count=20, self_cpu_time_total=300.0, self_device_time_total=0.0)]
    host = profile.table(events, calls=20, rows=5, device=False)
    assert host[2:4] == ["| b/c | 1 | 15.0 |", "| a | 2 | 5.0 |"]
    assert host[-1].endswith("per call: 20.0 µs")
    device = profile.table(events, calls=20, rows=1, device=True)
    assert device[2:] == ["| a | 2 | 5.0 | 45.0 |", "\nself host time of every op, per call: 20.0 µs; self device time: 45.0 µs"]


def _sections(output: str) -> list[list[str]]:
    """Each method's table rows."""
    return [[line for line in section.splitlines() if re.match(r"\| .+ \| [\d.]+ \| [\d.]+ \|$", line)]
            for section in output.split("forward+backward calls profiled")[1:]]


def test_bench_profile_prints_a_table_per_method():
    result = CliRunner().invoke(main, ["bench", "--profile", "--batch", "8", "--horizon", "8"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for title in profile.METHODS.values():
        assert f"\n{title}: B=8, H=8, float32, cpu; {profile.CALLS} forward+backward calls profiled" in result.output
    sections = _sections(result.output)
    assert len(sections) == len(profile.METHODS) and all(sections), result.output


def test_every_method_runs_the_step_once_per_call():
    printed: list[str] = []
    profile.run_cases([CostCase(8, horizon=8)], printed.append, rows=1000)  # every op
    for rows in _sections("\n".join(printed)):
        # the step's own op or autograd node, once per call in every method
        assert any(re.search(r"tensorstep|Step", line) and "| 1 |" in line for line in rows), rows


def test_bench_profile_takes_the_costs_case_options_only():
    result = CliRunner().invoke(main, ["bench", "--profile", "--quick"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "error: --profile profiles the costs bench's methods" in result.output and "--quick" in result.output
    result = CliRunner().invoke(main, ["bench", "--profile", "--scheme", "central"])
    assert result.exit_code != 0 and "--scheme central" in result.output
