"""Backends end to end on tiny workloads (spawned processes)."""

import numpy as np
import pytest

from rdma_kv.bench import baselines, cma, nixl_peer, runner
from rdma_kv.bench.workloads import Workload

TINY = Workload("tiny", "kv", num_layers=2, blocks_per_request=8, block_nbytes=4096, pool_blocks=16, seed=11)
TINY_CONTIG = TINY.replace(name="tiny-contig", block_order="contiguous")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.mark.parametrize("w", [TINY, TINY_CONTIG, Workload("c", "contiguous", nbytes=1 << 20)])
def test_cma_moves_and_verifies(w):
    r = cma.run_backend(w, 2)
    assert r.status == "ok", r.reason
    assert r.nbytes == [w.transfer_nbytes] * 2 and len(r.seconds) == 2
    if w is TINY_CONTIG:
        assert r.ops == [4, 4]  # 2 layers x K/V, each one run of 8 blocks


@pytest.mark.parametrize("w", [TINY, Workload("c", "contiguous", nbytes=1 << 20)])
def test_cma_with_threads_moves_and_verifies(w):
    """cma-tN: the batch cut across N reader threads still lands bit-exact
    (the reader verifies every rep)."""
    r = cma.run_backend(w, 2, threads=3)
    assert r.status == "ok", r.reason
    assert r.nbytes == [w.transfer_nbytes] * 2 and all(s > 0 for s in r.seconds)


def _bytes(iov) -> np.ndarray:
    """Every byte address iovecs cover, in order (``IOVEC`` records or (base, length) pairs)."""
    pairs = np.array(iov.tolist() if hasattr(iov, "tolist") else iov, dtype=np.int64).reshape(-1, 2)
    base, length = pairs[:, 0], pairs[:, 1]
    starts = np.cumsum(length) - length
    return np.repeat(base - starts, length) + np.arange(int(length.sum()), dtype=np.int64)


def test_split_iovecs_covers_every_byte_once_from_its_own_source():
    """Byte by byte, vectorised (the per-byte Python sets this test held
    before took 13 s of CPU, past its 180 s timeout on a loaded host)."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        n = int(rng.integers(1, 9))
        lengths = rng.integers(1, 5 * cma.PAGE, n).astype(np.uint64)
        local, remote = cma.build_iovecs(1 << 30, 1 << 40, np.cumsum(lengths) - lengths,
                                         rng.integers(0, 1 << 20, n).astype(np.uint64), lengths)
        parts = int(rng.integers(2, 5))
        slices = cma.split_iovecs(local, remote, parts)
        assert 1 <= len(slices) <= parts
        got_l = np.concatenate([_bytes(lp) for lp, _ in slices])
        got_r = np.concatenate([_bytes(rp) for _, rp in slices])
        want_l, want_r = _bytes(local), _bytes(remote)
        assert len(np.unique(got_l)) == len(got_l) == len(want_l)  # no local byte twice, none missed
        order, want = np.argsort(got_l), np.argsort(want_l)
        assert np.array_equal(got_l[order], want_l[want])  # every local byte once
        assert np.array_equal(got_r[order], want_r[want])  # and from its own remote byte


def test_child_failure_is_forwarded_with_traceback():
    with pytest.raises(runner.BenchError, match="target exploded on purpose"):
        runner.run_pair("bench_failing_backend", TINY, 1, setup_timeout_s=60)


def test_runner_reports_failed_and_unknown_backends():
    baselines.register_backend("broken", lambda w, reps: runner.run_pair("bench_failing_backend", w, reps))
    try:
        results = baselines.run([TINY], backends=["cma", "broken"], reps=1)
    finally:
        del baselines.BACKENDS["broken"]
    assert [r.status for r in results] == ["ok", "failed"]
    assert "target exploded" in results[1].reason


@pytest.mark.skipif(nixl_peer.nixl_available() is not None, reason="nixl is not importable")
@pytest.mark.parametrize("mode", ["strided", "blocks"])
def test_nixl_moves_verifies_and_merges(mode):
    r = nixl_peer.run_backend(TINY_CONTIG, 2, list_mode=mode)
    assert r.status == "ok", r.reason
    assert r.ops == [4, 4]  # NIXL merged each region's run of blocks
    assert r.prep_seconds and r.post_seconds


def test_missing_nixl_is_reported_as_skipped(monkeypatch):
    monkeypatch.setattr(nixl_peer, "nixl_available", lambda: "nixl is not importable (test)")
    r = nixl_peer.run_backend(TINY, 1)
    assert r.status == "skipped" and "not importable" in r.reason


@pytest.mark.parametrize("lanes", [1, 2])
def test_rdmakv_with_notify_moves_verifies_and_each_rep_notifies(lanes):
    """--notify: every rep's read carries a notification and the target
    checks at close that exactly one arrived per repetition."""
    w = TINY.replace(name="tiny-big", block_nbytes=64 << 10)  # 2 MiB a request: two 1 MiB parts
    r = baselines.rdmakv_peer.run_backend(w, 3, notify=True, lanes=lanes)
    assert r.status == "ok", r.reason
    assert r.nbytes == [w.transfer_nbytes] * 3 and r.config["notify"] is True and r.config["lanes"] == lanes


@pytest.mark.skipif(nixl_peer.nixl_available() is not None, reason="nixl is not importable")
def test_nixl_with_notify_moves_verifies_and_each_rep_notifies():
    r = nixl_peer.run_backend(TINY, 3, notify=True)
    assert r.status == "ok", r.reason
    assert r.config["notify"] is True


def test_a_missing_or_extra_notification_fails_the_target():
    with pytest.raises(runner.BenchError, match=r"expected one notification per repetition \(2\), got 1"):
        runner.await_notifications(lambda: [b"rep0"], [b"rep0", b"rep1"], 0.05, "test target")
    with pytest.raises(runner.BenchError, match="extra"):
        runner.await_notifications(lambda: [b"rep0", b"rep0"], [b"rep0"], 0.05, "test target")
    runner.await_notifications(lambda: [b"rep1", b"rep0"], [b"rep0", b"rep1"], 0.05, "test target")


def test_rounds_alternate_the_backends_and_pool_their_reps():
    calls = []

    def fake(name, seconds):
        def run(w, reps):
            calls.append(name)
            return baselines.Result.from_records(name, w, [{"seconds": seconds, "ops": 1, "nbytes": 100}] * reps)
        return run

    baselines.register_backend("fake-a", fake("fake-a", 1.0))
    baselines.register_backend("fake-b", fake("fake-b", 2.0))
    try:
        results = baselines.run([TINY], backends=["fake-a", "fake-b"], reps=2, rounds=3)
    finally:
        del baselines.BACKENDS["fake-a"], baselines.BACKENDS["fake-b"]
    assert calls == ["fake-a", "fake-b"] * 3
    assert [r.backend for r in results] == ["fake-a", "fake-b"]
    assert results[0].seconds == [1.0] * 6 and results[1].seconds == [2.0] * 6
    assert results[0].config["rounds"] == 3
