"""Routes (prepared.py): a request between the same prepared lists is one C
call (``rk_submit``) on a route built by the checked path; anything that
could stale a route sends the next request through the checked path again,
and an endpoint UCX failed meanwhile stops the one-call path.
"""

from __future__ import annotations

import numpy as np
import pytest

from rdma_kv.errors import DescriptorError, PeerError
from transport_helpers import PAIR_NBYTES, connect, prepare_slots, wait_until

pytestmark = [pytest.mark.ucx]

BLOCK = 4096
WAIT_S = 20.0


def counting_slow_path(agent) -> list[int]:
    """Count the requests that take the checked (slow) path."""
    calls = [0]
    slow = agent._core.prepared._checked

    def counted(*args, **kwargs):
        calls[0] += 1
        return slow(*args, **kwargs)

    agent._core.prepared._checked = counted
    return calls


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_route_is_built_once_and_rebuilt_after_any_change(make_agent, lanes):
    """The second request between the same lists is one C call; anything
    that could stale the route (regions, peers, another local list) sends
    the next request through the checked path (a notification does not),
    and every request stays bit-exact."""
    pair = connect(make_agent, lanes=lanes, lane_min_bytes=16 * BLOCK)
    local, remote = prepare_slots(pair, BLOCK)
    slow = counting_slow_path(pair.b)
    idx = np.arange(64)

    def read(lst=local, **kw):
        pair.buf_b[:] = 0
        pair.b.read_prepared(lst, idx, remote, idx, **kw).wait(WAIT_S)
        np.testing.assert_array_equal(pair.buf_b[: 64 * BLOCK], pair.buf_a[: 64 * BLOCK])

    read()
    read()
    read()
    assert slow[0] == 1
    extra = np.zeros(1 << 16, dtype=np.uint8)
    pair.b.register(extra)  # new memory handles: stale
    read()
    read()
    assert slow[0] == 2
    other = pair.b.prep_local(pair.desc_b(np.arange(PAIR_NBYTES // BLOCK) * BLOCK, BLOCK))
    read(other)  # another local list: the remote list's one route is rebuilt for it
    read(local)
    assert slow[0] == 4
    read(notify=b"x")  # a notification rides the route too
    assert slow[0] == 4
    wait_until(lambda: any(n.payload == b"x" for n in pair.a.get_notifications()), WAIT_S, "notification")
    pair.b.add_peer(pair.a.metadata())  # the peer replaced: lists for it must be prepared again
    with pytest.raises(DescriptorError, match="earlier incarnation"):
        pair.b.read_prepared(local, idx, remote, idx)
    assert pair.b.stats.failed == 0


def test_an_endpoint_failed_by_ucx_stops_the_fast_path(make_agent):
    """UCX fails an endpoint asynchronously (its error callback sets the
    endpoint state); the next request on a current route must not be
    posted on it but fail with the peer error."""
    pair = connect(make_agent, lanes=2, lane_min_bytes=16 * BLOCK, progress="poll")
    local, remote = prepare_slots(pair, BLOCK)
    idx = np.arange(64)
    pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)  # builds the route
    posted = pair.b.stats.ops_posted
    lane_peer = pair.b._core.lanes[0].peers["a"]
    lane_peer.ep_state.status = -25  # as rk_ep_error_cb writes it (UCS_ERR_ENDPOINT_TIMEOUT... any error)
    lane_peer.ep_state.failed = 1
    with pytest.raises(PeerError, match=r"peer 'a' failed \(lane 1's endpoint failed"):
        pair.b.read_prepared(local, idx, remote, idx)
    assert pair.b.stats.ops_posted == posted and pair.b.inflight == 0
