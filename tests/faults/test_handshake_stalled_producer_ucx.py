"""A producer that stops answering a while (SIGSTOP: a loaded host can
leave a process unscheduled for seconds) when the decode must handshake
with it again, after it answered the decode before: the loads wait (the
peer is STALLED and dialled again), and finish verified once it answers.
Before, the HANDSHAKE call's attempts decided, and every load waiting on
it recomputed (``consumer.peers``). The second handshake here follows the
producer's sleep and wake (its KV cache registered again: the decode's
keys of it are void); a read failure or an idle prune lead to one too.
Engines in two processes, KV over UCX loopback."""

from __future__ import annotations

import collections
import os
import signal

import pytest

from faults_util import prefill
from procstop import stop
from test_confirm_stalled_producer import SHAPE, stalled_config

from rdma_kv.harness.process import EngineProcess, HarnessError

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(240)]

LEASES = {"lease_ttl_s": 120.0}
"""The prefills' leases outlive the stall (the producer's clock runs while it is stopped)."""


class Unanswered:
    """The decode's ``handshakes_unanswered`` so far: its stats count what
    happened since the last call (None when nothing did), so the counts
    are summed. (Taking the last count as the total, as this did first,
    read 0 after a report that carried other events.)"""

    def __init__(self, d: EngineProcess) -> None:
        self.d, self.totals = d, collections.Counter[str]()

    def __call__(self) -> int:
        stats = self.d.call("stats")
        if stats is not None:
            self.totals.update({k: v for k, v in stats["totals"].items() if isinstance(v, int) and v})
        return self.totals["handshakes_unanswered"]

    def why(self) -> str:
        """What the decode holds and counted meanwhile (a failure's message:
        where its loads wait, its peers, clients and calls queued)."""
        return (f"decode status {self.d.call('status')}; its loads {self.d.call('loads')}; its counters "
                f"since the stop {dict(self.totals)}")


def ended(d: EngineProcess, ids: list[str]) -> bool:
    """Whether a result of ``ids`` came back (taking in those that arrived)."""
    d.pump()
    return any(rid in d.results for rid in ids)


def test_loads_outlive_a_producer_stalled_at_the_handshake_after_its_wake(rng):
    with EngineProcess("prefill-h", stalled_config("kv_producer", "PH", **LEASES), SHAPE) as p, \
            EngineProcess("decode-h", stalled_config("kv_consumer", "DH", load_timeout_s=120.0, **LEASES),
                          SHAPE) as d:
        prompts = {f"h{i}": rng.integers(1, 999, int(rng.integers(40, 200))).tolist() for i in range(7)}
        ids = list(prompts)
        warm = prefill(p, {ids[0]: prompts[ids[0]]})
        d.add(ids[0], prompts[ids[0]], warm[ids[0]])  # the first handshake: the producer answers
        first = d.wait_results(ids[:1], timeout_s=30)[ids[0]]
        assert first["status"] == "finished" and not first["load_failed"], first
        p.call("sleep")
        p.call("wake_up")  # registered again: the next load handshakes again
        params = prefill(p, {rid: prompts[rid] for rid in ids[1:]})
        unanswered = Unanswered(d)
        stop(p.pid)  # (every thread stopped, not only the stop queued)
        try:
            for rid in ids[1:]:
                d.add(rid, prompts[rid], params[rid])
            # Not answered once (a call's attempts, ~15 s at HANDSHAKE_TIMEOUT_S): before, every load failed here.
            try:
                d.wait_status(lambda s: unanswered() >= 1 or ended(d, ids[1:]), timeout_s=90)
            except HarnessError as exc:
                raise AssertionError(f"{exc}; {unanswered.why()}") from None
            assert not ended(d, ids[1:]), {rid: d.results[rid]["error"] for rid in ids[1:] if rid in d.results}
            assert unanswered() >= 1
            os.kill(p.pid, signal.SIGCONT)
            results = d.wait_results(ids[1:], timeout_s=150)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        for rid, r in results.items():
            assert r["status"] == "finished" and not r["load_failed"], (rid, r["error"])
            assert r["bad_blocks"] == [], f"{rid}: blocks {r['bad_blocks']} differ from its producer's"
