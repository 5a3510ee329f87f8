"""Idle steps wait for their loads (``idle_wait_s``): a step in which no
request computes marks its metadata ``idle``, and its ``get_finished``
waits, bounded, for a load in flight to finish, so that the same step
reports it. Harness engines on the fake transport, whose reads are held
and released by the test."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from fakes import FakeFabric
from rdma_testutil import prefill_then_decode, wait_until

from rdma_kv.connector import KVTransferConfig, RequestId, SchedulerOutput
from rdma_kv.connector.rdma import RdmaConnector
from rdma_kv.errors import ConfigError
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(60)

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64, dtype="float32")


def config(role: str, engine_id: str, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_connector_extra_config={"rpc_timeout_s": 2.0, "load_timeout_s": 20.0, **extra})


@contextlib.contextmanager
def admitted_with_reads_held(rng, idle_wait_s: float) -> Iterator[tuple[FakeFabric, Engine, Engine]]:
    """A producer and a decode (``idle_wait_s``) on the fake transport:
    handshake with a warm load, prefill "r" and ship its grant (and held
    words), then hold the fake's reads and hand "r" to the decode."""
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P"), SHAPE, connector_kwargs=kw)
    D = Engine(config("kv_consumer", "D", idle_wait_s=idle_wait_s), SHAPE, connector_kwargs=kw)
    try:
        prefill_then_decode(P, D, {"warm": rng.integers(1, 999, 9).tolist()})
        prompt = rng.integers(1, 999, 13).tolist()
        P.add_request("r", prompt, {"do_remote_decode": True})
        P.run(until=lambda: P.results.get("r") is not None and P.results["r"].status.value == "finished")
        P.step()  # ships the lease grant to the producer's worker
        fabric.hold = True
        D.add_request("r", prompt, P.results["r"].kv_transfer_params)
        yield fabric, P, D
    finally:
        P.shutdown()
        D.shutdown()


@pytest.mark.parametrize("value", [-0.001, 1.5, float("nan")])
def test_idle_wait_s_is_checked(value):
    with pytest.raises(ConfigError, match="idle_wait_s must be in"):
        Engine(config("kv_consumer", "D", idle_wait_s=value), SHAPE, connector_kwargs={
            "transport_factory": FakeFabric().factory})


def test_a_step_is_idle_when_no_request_computes_in_it():
    fabric = FakeFabric()
    D = Engine(config("kv_consumer", "D"), SHAPE, connector_kwargs={"transport_factory": fabric.factory})
    try:
        sched = D.scheduler
        assert isinstance(sched, RdmaConnector)
        assert sched.build_connector_meta(SchedulerOutput()).idle
        assert not sched.build_connector_meta(SchedulerOutput(num_scheduled_tokens={RequestId("r"): 1})).idle
    finally:
        D.shutdown()


def test_an_idle_step_reports_a_load_that_finishes_while_it_waits(rng):
    """The decode's reads are held; a thread releases them once posted. With
    a long ``idle_wait_s`` the very step that admitted the request and
    posted its reads reports the load: the reads were waited for, and the
    CONFIRM answered, within that step's ``get_finished``."""
    with admitted_with_reads_held(rng, idle_wait_s=1.0) as (fabric, P, D):

        def release() -> None:
            wait_until(lambda: bool(fabric.pending), 10.0, what="the read posted")
            fabric.hold = False
            fabric.release_all()

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        out = D.step()  # admits "r", posts its reads, and waits in get_finished
        releaser.join(10)
        assert "r" in out.finished_recving, "the step that posted the load did not wait for it"
        D.run(until=lambda: D.results["r"].status.value == "finished")
        assert not D.results["r"].load_failed and D.results["r"].bad_blocks == []


def test_an_idle_step_waits_once_more_for_held_words_posted_as_its_time_ran_out(rng, monkeypatch):
    """The reads land, and their held words' read is posted, while the idle
    step waits; the words' read lands only after ``idle_wait_s`` (1 s,
    released at 1.3 s): the step waits for it (once, at most
    ``WORDS_GRACE_S`` more, here 1 s: 0.7 s to spare for a loaded host) and
    reports the load, rather than leaving it to the next step."""
    from rdma_kv.connector.rdma.consumer import words

    monkeypatch.setattr(words, "WORDS_GRACE_S", 5.0)  # the grace is then idle_wait_s (it is at most that)
    with admitted_with_reads_held(rng, idle_wait_s=1.0) as (fabric, P, D):
        released, began = threading.Event(), time.perf_counter()

        def release() -> None:
            wait_until(lambda: bool(fabric.pending), 10.0, what="the reads posted")
            fabric.release_all()  # the data lands; its held words' read is posted (and held)
            wait_until(lambda: bool(fabric.pending), 10.0, what="the held words' read posted")
            time.sleep(max(0.0, began + 1.3 - time.perf_counter()))  # idle_wait_s is over; its grace is not
            released.set()
            fabric.hold = False
            fabric.release_all()

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        out = D.step()
        releaser.join(10)
        assert released.is_set()
        assert "r" in out.finished_recving, "the idle step did not wait for the held words' read"
        assert not D.results.get("r") or not D.results["r"].load_failed
        D.run(until=lambda: D.results["r"].status.value == "finished")
        assert not D.results["r"].load_failed and D.results["r"].bad_blocks == []
