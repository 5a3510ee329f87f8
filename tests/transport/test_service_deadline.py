"""The service thread enforces a deadline that comes due during its sleep.

``progress="thread"``: only the service thread fails a transfer at its
deadline when no caller waits on it (a caller that steps an engine and
looks at ``done()``, or a completion callback, as the connector uses it).
It sleeps until the earliest deadline it knew when it went to sleep, at
most ``SERVICE_SLEEP_S``. A transfer posted during that sleep with a
shorter timeout was failed only when the sleep ended: up to a second late
(``SERVICE_SLEEP_S`` 1 s), which is where ``tcp_teardown_child.py`` spent
30 of its 33 s. Now the sleep looks at the deadlines each time it looks at
the pumps (every 20-100 ms) and sleeps no longer than the next one.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from transport_helpers import TCP, wait_until

from rdma_kv.errors import TransferTimeoutError
from rdma_kv.transport import DescList, progress

pytestmark = [pytest.mark.ucx]


def test_a_deadline_shorter_than_the_service_threads_sleep_is_enforced(make_agent, monkeypatch):
    # The sleep made ten minutes: the test's 30 s bound below ends long before it would.
    monkeypatch.setattr(progress, "SERVICE_SLEEP_S", 600.0)
    target = make_agent("target", progress="poll", ucx_options=TCP, lanes=1)  # never progressed: it hangs
    reader = make_agent("reader", ucx_options=TCP, lanes=1)
    theirs, mine = np.full(1 << 16, 7, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    target.register(theirs)
    reader.register(mine)
    reader.add_peer(target.metadata())
    target.add_peer(reader.metadata())
    loc, rem = DescList([mine.ctypes.data], 1 << 16), DescList([theirs.ctypes.data], 1 << 16)
    warm = reader.read("target", loc, rem)
    wait_until(warm.done, 30.0, "a first read", drive=[target])
    time.sleep(0.3)  # the service thread back in its (now ten-minute) sleep, nothing in flight
    failed: list[BaseException | None] = []
    xfer = reader.read("target", loc, rem, timeout_s=0.2)
    xfer.add_done_callback(lambda x: failed.append(x.error))
    # Nobody waits on it or settles it: the service thread alone must fail it, and run its callback.
    end = time.monotonic() + 30.0
    while not failed and time.monotonic() < end:
        time.sleep(0.01)
    assert failed, "the deadline passed during the service thread's sleep and was not enforced within 30 s"
    assert len(failed) == 1 and isinstance(failed[0], TransferTimeoutError), failed
    assert xfer.done()
