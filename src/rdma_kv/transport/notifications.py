"""The notification ring: what peers sent this agent.

A notification is an eager active message (id ``NOTIF_AM_ID``): the header
is the sender's agent name, the data the payload (at most
``notif_max_bytes``). The shim's receive handler copies each into a ring
of fixed-size slots in the agent's C context (``rk_ctx_t``); a full ring
drops the message and counts it. ``Notifications`` owns that ring's
memory, installs the handler on the agent's worker, moves what arrived
into a queue of ``Notification`` records (``drain``, under the agent's
lock, as part of settling) and hands them out (``take``); it says in the
log how many were dropped and what to raise.

It also fills in what the shim needs to *send* one: the agent's name as
header, the active-message id and the size bound (``rk_submit`` refuses a
longer payload).

May import: rdma_kv.transport._lib, .config, .metadata, .ucx.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

from rdma_kv.transport import metadata as wire
from rdma_kv.transport._lib import check_status, load
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.ucx import Worker

log = logging.getLogger("rdma_kv.transport.agent")

NOTIF_AM_ID = 0x524B  # "RK": active-message id of rdma-kv notifications


@dataclass(frozen=True)
class Notification:
    """A notification from ``peer``, delivered after its transfer completed."""

    peer: str
    payload: bytes


class Notifications:
    """The notification ring of the agent ``name`` in ``ctx`` (its
    ``rk_ctx_t *``), received on ``worker``."""

    def __init__(self, name: str, ctx: Any, worker: Worker, config: AgentConfig) -> None:
        ffi, lib = load()
        self._name = name
        self._ctx = ctx
        self._nslots = config.notif_slots
        slot = config.notif_max_bytes + wire.MAX_NAME_BYTES + 8
        self._mem = ffi.new("uint8_t[]", config.notif_slots * slot)
        self._view = memoryview(ffi.buffer(self._mem))
        ctx.notif_slots = self._mem
        ctx.notif_slot_size = slot
        ctx.notif_nslots = config.notif_slots
        # What a notification carries (rk_submit, csrc/core.c).
        self._name_c = ffi.new("char[]", name.encode())
        ctx.name = self._name_c
        ctx.name_len = len(name.encode())
        ctx.am_id = NOTIF_AM_ID
        ctx.notif_max = config.notif_max_bytes
        check_status(lib.rk_set_notif_handler(worker.handle, NOTIF_AM_ID, ctx), "ucp_worker_set_am_recv_handler")
        self._queue: deque[Notification] = deque()
        self.dropped = 0  # drops logged so far (the shim's two counters, summed)

    def drain(self) -> None:
        """Move what arrived into the queue; log drops. Under the agent's lock."""
        ctx = self._ctx
        head = ctx.notif_head
        if head != ctx.notif_tail:
            size, nslots, view = ctx.notif_slot_size, ctx.notif_nslots, self._view
            tail = ctx.notif_tail
            while tail < head:
                off = (tail % nslots) * size
                hl, dl = struct.unpack_from("<II", view, off)
                sender = bytes(view[off + 8:off + 8 + hl]).decode("utf-8", "replace")
                self._queue.append(Notification(sender, bytes(view[off + 8 + hl:off + 8 + hl + dl])))
                tail += 1
            ctx.notif_tail = tail
        dropped = ctx.notif_dropped_full + ctx.notif_dropped_rndv
        if dropped != self.dropped:
            log.warning("agent %s dropped %d notifications (ring of %d full or oversized); "
                        "call get_notifications() more often or raise notif_slots",
                        self._name, dropped - self.dropped, self._nslots)
            self.dropped = dropped

    def take(self) -> list[Notification]:
        """Every notification queued, in arrival order. Under the agent's lock."""
        out = list(self._queue)
        self._queue.clear()
        return out
