"""bench/cuda_kernels.py's table from fake timings (its timings need a GPU), and its clean exit
without one; ``--min-blocks``: the bounds it sets, its children, their rounds and its table."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch

from tensorstep.bench import cuda_kernels
from tensorstep.bench.cuda_kernels import Row, table


def test_the_table_gives_throughput_and_the_fraction_of_a_copy():
    """72 MB in 90 µs is 800 GB/s; a copy of the same bytes in 18 µs makes it 20% of the copy."""
    rows = [Row("fused", "forward + cost_sum", "float32", 40000, 90.0, 72_000_000, 18.0),
            Row("plain", "adjoint", "float64", 400, 4.0, 1_000_000, 3.0)]
    lines = table(rows)
    assert lines[0] == cuda_kernels.HEADER and len(lines) == 4
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| fused | forward + cost_sum | float32 | 40000 | 90.0 | 72.0 | 800 | 18.0 | 20% |"
    assert lines[3] == "| plain | adjoint | float64 | 400 | 4.0 | 1.0 | 250 | 3.0 | 75% |"
    assert rows[0].gigabytes_per_second == pytest.approx(800.0) and rows[1].of_copy == pytest.approx(0.75)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the timings would run")
def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert cuda_kernels.main(["400"]) == 0
    assert "nothing timed" in capsys.readouterr().out


def test_the_launches_and_their_bytes(monkeypatch):
    """The four launches run (here on the CPU, the timings replaced: each launch called once), and
    each row's bytes are its interface's: the fused forward reads u, the start states and the
    per-trajectory weights and writes P and the cost; the plain forward writes four states."""
    calls = []
    monkeypatch.setattr(cuda_kernels, "median_microseconds", lambda launch: (calls.append(launch()), 10.0)[1])
    monkeypatch.setattr(cuda_kernels, "_copy_microseconds", lambda nbytes, device: 5.0)
    B, H, D, T = 5, 32, 7, 7
    rows = cuda_kernels.measure(B, "float64", torch.device("cpu"))
    assert [(r.step, r.kernel) for r in rows] == [("fused", "forward + cost_sum"), ("fused", "adjoint"),
                                                  ("plain", "forward"), ("plain", "adjoint")]
    assert len(calls) == 4 and all(r.of_copy == 0.5 for r in rows)
    u, starts, P, cost = B * (H - 1) * D, 3 * B * D, B * H * D, B * T
    weights = T * B * D  # each term's [D] weight as the [B, D] rows the kernels read
    shared = 4 * (2 * D + D) + T * H  # four bounds' limits [2, D] and margins [D]; each term's row weights [H]
    assert rows[0].bytes == 8 * (u + starts + weights + shared + P + cost)
    assert rows[2].bytes == 8 * (u + starts + 4 * P)
    assert rows[3].bytes == 8 * (P + u)  # P's gradient in, u's gradient out


def test_min_blocks_sets_the_fused_kernels_bounds_and_restores_the_rule():
    """Inside ``min_blocks(n)`` the bench's fused forward and adjoint ask for n resident blocks, in
    both dtypes; outside, the rule's (the float32 forward 3, the rest 2)."""
    for n in (2, 4):
        with cuda_kernels.min_blocks(n):
            assert cuda_kernels.fused_bounds("float32") == {"forward": (256, n), "adjoint": (256, n)}
            assert cuda_kernels.fused_bounds("float64") == {"forward": (256, n), "adjoint": (256, n)}
    assert cuda_kernels.fused_bounds("float32") == {"forward": (256, 3), "adjoint": (256, 2)}
    assert cuda_kernels.fused_bounds("float64") == {"forward": (256, 2), "adjoint": (256, 2)}


def test_at_min_blocks_times_the_four_launches(monkeypatch):
    """A child's work (here on the CPU, the timings replaced): the bounds checked, then the four rows."""
    monkeypatch.setattr(cuda_kernels, "DTYPES", ("float64",))
    monkeypatch.setattr(cuda_kernels, "median_microseconds", lambda launch: (launch(), 10.0)[1])
    monkeypatch.setattr(cuda_kernels, "_copy_microseconds", lambda nbytes, device: 5.0)
    rows = cuda_kernels.at_min_blocks(4, [3], torch.device("cpu"))
    assert [(r.step, r.kernel, r.batch) for r in rows] == [("fused", "forward + cost_sum", 3), ("fused", "adjoint", 3),
                                                           ("plain", "forward", 3), ("plain", "adjoint", 3)]


def test_a_child_runs_with_its_own_cache_and_its_rows_come_back(monkeypatch):
    row = Row("fused", "adjoint", "float32", 400, 12.5, 1000, 2.0)
    seen = []

    def run(cmd, env, capture_output, text):
        seen.append((cmd, env["TENSORSTEP_CACHE_DIR"]))
        out = "a notice\n" + cuda_kernels.ROWS + json.dumps([dataclasses.asdict(row)]) + "\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(cuda_kernels.subprocess, "run", run)
    assert cuda_kernels.run_child(3, [400, 40000], "/tmp/x/n3") == [row]
    (cmd, cache), = seen
    assert cmd[1:] == ["-m", "tensorstep.bench.cuda_kernels", "--at-min-blocks", "3", "400", "40000"]
    assert cache == "/tmp/x/n3"


def test_min_blocks_interleaves_the_rounds_and_tables_the_medians(monkeypatch, capsys):
    """``--min-blocks 2,3 --rounds 3``: each round runs n=2 then n=3, each n with one cache; a cell is
    the median over the rounds with their range, and n=3's time a fraction of n=2's."""
    order, caches = [], {}
    fake = {2: [100.0, 104.0, 102.0], 3: [82.0, 80.0, 81.0]}

    def child(n, batches, cache):
        order.append(n)
        caches.setdefault(n, set()).add(cache)
        t = fake[n][order.count(n) - 1]
        return [Row("fused", "forward + cost_sum", "float32", batches[0], t, 1000, 1.0)]

    monkeypatch.setattr(cuda_kernels, "no_gpu", lambda: None)
    monkeypatch.setattr(cuda_kernels, "run_child", child)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    assert cuda_kernels.main(["--min-blocks", "2,3", "--rounds", "3", "40000"]) == 0
    assert order == [2, 3] * 3 and all(len(c) == 1 for c in caches.values()) and caches[2] != caches[3]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "| step | kernel | dtype | B | n=2 (µs) | n=3 (µs) | n=3 / n=2 |"
    assert lines[3] == "| fused | forward + cost_sum | float32 | 40000 | 102.0 (100.0–104.0) | 81.0 (80.0–82.0) | 0.79 |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the timings would run")
def test_min_blocks_without_a_gpu_says_so_and_exits_0(capsys):
    assert cuda_kernels.main(["--min-blocks", "2,3,4", "400"]) == 0
    assert "nothing timed" in capsys.readouterr().out
