"""How :class:`~rdma_kv.harness.process.EngineProcess` starts its child: a
fork of a fork server that imported torch once, which must still behave as
a freshly spawned child would: the child takes the parent's environment
and output as they are when *it* starts, not as they were when the fork
server started (an earlier test's, or before the caller redirected them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess, HarnessError

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=16, block_size=16, num_blocks=64)


def config(engine_id: str) -> dict:
    return {"kv_connector": "RdmaKVConnector", "kv_role": "kv_producer", "engine_id": engine_id, "kv_port": 0}


@pytest.fixture(scope="module")
def fork_server_running() -> Iterator[None]:
    """An engine started and closed before the test's own capture begins, so
    that the fork server runs with the session's output and environment."""
    with EngineProcess("first", config("first"), SHAPE) as first:
        assert first.pid > 0
    yield


def test_an_engine_takes_the_environment_and_stderr_of_its_own_start(fork_server_running, monkeypatch, capfd):
    capfd.readouterr()
    monkeypatch.setenv("UCX_TLS", "no_such_transport")
    # Before the child took the parent's environment, it started with the
    # fork server's UCX_TLS and came up fine; before it took the parent's
    # stderr, UCX's and the engine's words went to the output of whoever started the server.
    with pytest.raises(HarnessError, match="ucp_init failed"):
        EngineProcess("second", config("second"), SHAPE, start_timeout_s=60)
    out, err = capfd.readouterr()
    assert "transport 'no_such_transport' is not available" in out, out  # UCX logs to stdout
    assert "second WARNING rdma_kv.transport.agent" in err and "ucp_init failed" in err, err


def test_an_engine_after_the_environment_is_restored_starts_and_serves(fork_server_running):
    with EngineProcess("third", config("third"), SHAPE) as engine:
        assert engine.call("status")["free_blocks"] == SHAPE.num_blocks
