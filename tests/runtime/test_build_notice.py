"""The 'tensorstep: compiling ...' notice is about the user's wait: the builds of one wait (one call's,
a load's and its first call's) print one line once they have run ``cache.SLOW_BUILD_S`` in all, naming
what they build; a warm call prints nothing. Builds are faked with sleeps at a short threshold (the
helper every build site uses), except one test's real cache misses, which print at once."""
from __future__ import annotations

import threading
import time

import pytest

import tensorstep as ts
from tensorstep.runtime import cache, cbackend

THRESHOLD_S = 0.6
BUILD_S = 0.4  # two builds pass the threshold, one does not (0.2 s of slack either side)


@pytest.fixture
def wait(monkeypatch):
    """A wait of this test's own, at a short threshold."""
    monkeypatch.setattr(cache, "_WAIT", cache._Wait())
    monkeypatch.setattr(cache, "SLOW_BUILD_S", THRESHOLD_S)
    monkeypatch.setattr(cache, "WAIT_GAP_S", 1.0)


def build(name: str, what: str, seconds: float = BUILD_S) -> None:
    notice = cache.building(name, what, 8)
    try:
        time.sleep(seconds)
    finally:
        notice.cancel()


def notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("tensorstep: compiling")]


def test_a_chain_of_short_builds_says_once_what_it_builds(wait, capfd):
    build("fused", "core kernels")
    build("fused", "the general form of its core kernels")  # the wait passes the threshold in this one
    build("plain", "dt_vjp kernels")
    assert notices(capfd.readouterr().err) == [
        "tensorstep: compiling fused (core kernels, the general form of its core kernels, H=8)..."]


def test_a_single_long_build_says_so_once(wait, capfd):
    build("fused", "core kernels", THRESHOLD_S + 0.3)
    assert notices(capfd.readouterr().err) == ["tensorstep: compiling fused (core kernels, H=8)..."]


def test_a_short_wait_and_a_warm_call_print_nothing(wait, capfd):
    build("fused", "core kernels")
    time.sleep(0.05)  # its timer, cancelled, does not print late
    assert notices(capfd.readouterr().err) == []
    cache.building("fused", "core kernels", 8).cancel()  # found built at once
    time.sleep(THRESHOLD_S + 0.1)
    assert notices(capfd.readouterr().err) == []


def test_builds_apart_are_waits_of_their_own(wait, monkeypatch, capfd):
    monkeypatch.setattr(cache, "WAIT_GAP_S", 0.1)
    build("fused", "core kernels")
    time.sleep(0.3)
    build("fused", "the general form of its core kernels")
    assert notices(capfd.readouterr().err) == []


def test_builds_side_by_side_count_the_time_one_ran(wait, capfd):
    """Threads building at once wait together: the time some build ran counts, not the sum."""
    threads = [threading.Thread(target=build, args=("fused", f"form {i}")) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert notices(capfd.readouterr().err) == []
    build("fused", "form 3")  # the same wait: past the threshold now
    [line] = notices(capfd.readouterr().err)
    prefix, suffix = "tensorstep: compiling fused (", ", H=8)..."
    assert line.startswith(prefix) and line.endswith(suffix)
    named = line[len(prefix):-len(suffix)].split(", ")
    # the three threads' builds in the order they began, which the scheduler picks
    assert sorted(named[:3]) == ["form 0", "form 1", "form 2"] and named[3:] == ["form 3"]


def test_real_cache_misses_of_one_wait_print_one_line_and_warm_loads_none(monkeypatch, capfd, tmp_path):
    """Two libraries built one after the other (as a dt gradient's backward builds them): one line,
    printed at once here (threshold 0), naming what was being built; loaded again: nothing."""
    monkeypatch.setattr(cache, "_WAIT", cache._Wait())
    monkeypatch.setattr(cache, "SLOW_BUILD_S", 0.0)
    spec = ts.KernelSpec(horizon=9, dof=1, dtype="float64", dt="per_step", difference="backward")
    store = cache.BuildCache(tmp_path)
    cbackend.load_library(spec, "dt_vjp", store)
    cbackend.load_library(spec, "dt_jvp", store)
    assert notices(capfd.readouterr().err) == [f"tensorstep: compiling {spec.name} (dt_vjp kernels, H=9)..."]
    time.sleep(cache.WAIT_GAP_S)
    cbackend.load_library(spec, "dt_vjp", store)
    cbackend.load_library(spec, "dt_jvp", store)
    time.sleep(0.05)
    assert notices(capfd.readouterr().err) == []


def test_a_cuda_sources_generation_is_a_build_of_the_wait(wait, monkeypatch, tmp_path, capfd):
    """A CUDA load's source generation (faked: BUILD_S) and its NVRTC build (faked: BUILD_S) are one wait
    past the threshold, the line naming both; the source found in the cache is no build."""
    import types

    from tensorstep.codegen import arguments, driver
    from tensorstep.runtime import cuda_backend

    def generate(spec, targets, parts):
        time.sleep(BUILD_S)
        return types.SimpleNamespace(source=lambda target, part: f"// {spec.name} {part}\n", metadata={})

    monkeypatch.setenv("TENSORSTEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "generate", generate)
    spec = ts.KernelSpec(horizon=8, dof=1, dtype="float64")
    for attempt in ("generated", "cached"):
        cuda_backend.cuda_source.cache_clear()
        assert cuda_backend.cuda_source(spec, "core")[0] == f"// {spec.name} core\n"
        notices_ = cuda_backend.build_notices(spec, arguments.table(spec), "core")
        time.sleep(BUILD_S)  # NVRTC
        for notice in notices_:
            notice.cancel()
        expected = [f"tensorstep: compiling {spec.name} (the CUDA source of its core kernels, CUDA core kernels "
                    "with NVRTC, H=8)..."] if attempt == "generated" else []
        assert notices(capfd.readouterr().err) == expected, attempt
        time.sleep(cache.WAIT_GAP_S)  # the next attempt is a wait of its own
    cuda_backend.cuda_source.cache_clear()


def test_the_cost_kinds_sympy_run_is_a_build_of_the_wait(wait, monkeypatch, tmp_path, capfd):
    """The cost kinds' functions made with SymPy (faked: BUILD_S) and a library's build (BUILD_S) are one
    wait past the threshold, the line naming both; kept kinds are no build."""
    from tensorstep.runtime import costs

    def lambdified():
        time.sleep(BUILD_S)
        return {"bound": "def _lambdifygenerated(y, w, lower, upper, margin, target):\n    return y\n"}

    monkeypatch.setenv("TENSORSTEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_lambdified", lambdified)
    for attempt in ("made", "kept"):
        costs.sources.cache_clear()
        assert set(costs.sources()) == {"bound"}
        build("fused", "core kernels")
        kinds = "the cost kinds (their PyTorch functions, with SymPy); " if attempt == "made" else ""
        expected = [f"tensorstep: compiling {kinds}fused (core kernels, H=8)..."] if attempt == "made" else []
        assert notices(capfd.readouterr().err) == expected, attempt
        time.sleep(cache.WAIT_GAP_S)
    costs.sources.cache_clear(), costs.pointwise.cache_clear()
