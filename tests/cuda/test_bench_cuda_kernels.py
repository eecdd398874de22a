"""bench/cuda_kernels.py's table from fake timings (its timings need a GPU), and its clean exit
without one."""
from __future__ import annotations

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
