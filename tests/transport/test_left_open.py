"""An endpoint left open for a hung peer is closed once its flushes end.

A peer's close waits for the flushes outstanding on its endpoint (UCX 1.22
crashes when a forced close frees an endpoint a flush still points at:
docs/reliability.md); a peer that hangs holds them, so the close leaves the
endpoint open. Before, it stayed open until the agent closed (an endpoint,
on InfiniBand a queue pair, per hang, for the engine's lifetime), and the
transfers the agent had failed on it kept ``deregister()`` refused. Now it
is closed once its flushes end: when the peer answers late (at the agent's
next peer change), or when UCX gives the peer up and fails them (an
endpoint error, which the agent's settle looks at).
"""

from __future__ import annotations

import pytest

from transport_helpers import TCP, hung_peer, wait_until

WAIT_S = 30.0

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]


def test_left_open_until_the_peer_answers_then_closed_at_the_next_peer_change(make_agent):
    target, reader, region, _ = hung_peer(make_agent)
    worker = reader._core.worker
    assert [p.name for p in worker.left_open] == ["target"], "the hung peer's endpoint was left open"
    peer = worker.left_open[0]
    wait_until(lambda: peer.ep_state.flushing == 0, WAIT_S, "the late peer to answer the flush", drive=[target])
    other = make_agent("other", progress="poll", ucx_options=TCP, lanes=1)
    reader.add_peer(other.metadata())
    assert worker.left_open == [] and peer._eps == [], "closed at the next peer change"
    wait_until(lambda: reader._core.inflight.zombies == 0, WAIT_S, "UCX to hand the failed read back",
               drive=[target])
    reader.deregister(region)  # nothing failed is held by UCX any more


def test_left_open_until_the_peer_dies_then_closed_by_the_endpoint_error(make_agent):
    target, reader, region, _ = hung_peer(make_agent)
    worker = reader._core.worker
    assert [p.name for p in worker.left_open] == ["target"], "the hung peer's endpoint was left open"
    target.close()  # the hung peer's process goes: its connection resets, UCX fails the endpoint
    wait_until(lambda: worker.left_open == [], WAIT_S, "the endpoint closed after UCX failed it")
    wait_until(lambda: reader._core.inflight.zombies == 0, WAIT_S, "UCX to hand the failed read back")
    reader.deregister(region)
