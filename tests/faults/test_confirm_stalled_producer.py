"""A producer that stops answering a while (SIGSTOP: a loaded host can
leave a process unscheduled for seconds) after the decode's reads landed:
the CONFIRM is made again until the load's deadline, and the loads finish
verified once it answers. A producer that never answers fails them at the
deadline, saying why. Before, the CONFIRM call's attempts decided (two in
4 s at the defaults): CI saw six loads of two stalled prefills recompute
(``could not confirm the lease ... unreachable after 2 attempts in 4.1 s:
timed out``). Engines in two processes, KV over UCX loopback.

With held words (protocol 12, the default), the same stopped producer
does not delay the loads at all: the words are read one-sided after the
data, like the data, and vouch for it (no CONFIRM is made)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from faults_util import config, prefill
from procstop import stop

from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(180)]

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=16, block_size=16, num_blocks=512)
RPC = {"rpc_timeout_s": 0.5, "connect_timeout_s": 0.5, "rpc_retries": 2}
"""One CONFIRM call's attempts end within ~3 s against a producer that is stopped."""
STALL_S = 6.0
"""Longer than one CONFIRM call's attempts, well inside the decode's load_timeout_s."""


def stalled_config(role: str, engine_id: str, words: bool = False, **extra: object) -> dict[str, object]:
    # The CONFIRM path: no pins, and (unless ``words``) a producer that publishes no held words.
    return config(role, engine_id, "fail", **RPC, read_timeout_s=10.0, read_pin=False, held_words=words, **extra)


def stalled_loads(rng, load_timeout_s: float, stall_s: float | None, words: bool = False
                  ) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    """Warm the decode's handshake with the producer, gate its reads, add 6
    loads, stop the producer, let the reads land; continue the producer
    ``stall_s`` later (None: only after the results). The loads' results,
    and the decode's counters."""
    with EngineProcess("prefill-s", stalled_config("kv_producer", "PS", words), SHAPE) as p, \
            EngineProcess("decode-s", stalled_config("kv_consumer", "DS", words, load_timeout_s=load_timeout_s), SHAPE,
                          faults={"gate_reads": True}) as d:
        prompts = {f"s{i}": rng.integers(1, 999, int(rng.integers(40, 200))).tolist() for i in range(7)}
        params = prefill(p, prompts)
        ids = list(prompts)
        d.add(ids[0], prompts[ids[0]], params[ids[0]])  # the handshake, before the producer stops
        warm = d.wait_results(ids[:1], timeout_s=30)[ids[0]]
        assert warm["status"] == "finished" and not warm["load_failed"], warm
        d.close_gate()
        for rid in ids[1:]:
            d.add(rid, prompts[rid], params[rid])
        d.wait_status(lambda s: s["inflight_loads"] == 6, timeout_s=30)
        stop(p.pid)  # (every thread stopped, not only the stop queued)
        try:
            d.open_gate()  # the reads land (shared memory: the stopped producer's CPU is not needed)
            if stall_s is not None:
                time.sleep(stall_s)
                os.kill(p.pid, signal.SIGCONT)
            results = d.wait_results(ids[1:], timeout_s=load_timeout_s + 60)
            return results, d.call("stats")["totals"]
        finally:
            os.kill(p.pid, signal.SIGCONT)


def test_loads_outlive_a_producer_stalled_longer_than_one_confirm_call(rng):
    results, totals = stalled_loads(rng, load_timeout_s=60.0, stall_s=STALL_S)
    assert totals["confirms_unanswered"] >= 1, totals  # counted: the CONFIRM was made again
    for rid, r in results.items():
        assert r["status"] == "finished" and not r["load_failed"], (rid, r["error"])
        assert r["bad_blocks"] == [], f"{rid}: blocks {r['bad_blocks']} differ from its producer's"


def test_a_producer_that_never_answers_fails_the_loads_at_their_deadline_saying_why(rng, capfd):
    results, totals = stalled_loads(rng, load_timeout_s=8.0, stall_s=None)
    assert totals["confirms_unanswered"] >= 1, totals
    assert all(r["status"] == "failed" and r["load_failed"] for r in results.values()), results
    logged = capfd.readouterr().err  # the decode's warnings (its stderr is this process's; a few per window)
    assert "KV load failed: not finished within load_timeout_s=8.0 (stage confirming): the CONFIRM to 'PS' " \
           "rank 0 is not answered: side channel" in logged, logged[-3000:]


def test_held_words_vouch_for_reads_while_the_producer_is_stopped(rng):
    # The producer stays stopped until every load is reported: nothing of it runs.
    results, totals = stalled_loads(rng, load_timeout_s=8.0, stall_s=None, words=True)
    assert totals["words_trusted"] == 7, totals  # (the warm load too)
    assert "confirms_unanswered" not in totals and "words_fallbacks" not in totals, totals
    for rid, r in results.items():
        assert r["status"] == "finished" and not r["load_failed"], (rid, r["error"])
        assert r["bad_blocks"] == [], f"{rid}: blocks {r['bad_blocks']} differ from its producer's"
