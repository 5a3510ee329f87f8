"""bench/wake_latency: the probe builds, wakes its sleeper and reports
ordered quantiles; bad arguments are refused with a message."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module():
    spec = importlib.util.spec_from_file_location("wake_latency", BENCH / "wake_latency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pytestmark = [
    pytest.mark.skipif(not _module().compiler(), reason="no C compiler"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probe needs two CPUs"),
]


def test_probe_reports_every_gap_with_ordered_quantiles():
    report = _module().run(20, [50, 200])
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert (report["poster_cpu"], report["sleeper_cpu"]) == tuple(cpus)
    assert report["reps"] == 20
    assert list(report["gaps"]) == ["50", "200"]
    for r in report["gaps"].values():
        for q in (r["write_us"], r["wake_us"]):
            assert 0 < q["p10"] <= q["median"] <= q["p90"]
        # The sleeper returns from epoll_wait only after the write began.
        assert r["wake_us"]["p10"] > 0


def test_a_gap_of_zero_wakes_the_sleeper_every_rep():
    """Back to back, the next write can come while the sleeper is still
    between its wake-up and its read of the fd; the probe must not lose it
    (it used to: the read took both writes, and the run died on its 1 s
    bound with "the sleeper did not wake")."""
    report = _module().run(400, [0])
    r = report["gaps"]["0"]
    assert 0 < r["wake_us"]["p10"] <= r["wake_us"]["median"] <= r["wake_us"]["p90"]


def test_probe_refuses_bad_arguments(tmp_path):
    exe = _module().build(str(tmp_path))
    for args, message in ((["5"], "REPS must be 10..100000"), (["20", "-1"], "GAP_US must be 0..1000000")):
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2
        assert message in proc.stderr


def test_probe_refuses_one_cpu(tmp_path):
    exe = _module().build(str(tmp_path))
    one = min(os.sched_getaffinity(0))
    proc = subprocess.run([exe, "10", "10"], capture_output=True, text=True, timeout=30,
                          preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert proc.returncode == 2
    assert "needs two CPUs" in proc.stderr
