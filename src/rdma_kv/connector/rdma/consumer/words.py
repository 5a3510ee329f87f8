"""Held words, the consumer's side: read a source's words after its data, and say whether they vouch for it.

Owns :class:`WordChecks`. A producer that publishes held words
(``heldwords``; the handshake reply's ``words``) names, in one 16-byte word
per block, the live lease that holds the block, and changes the word
before the block can go back to its engine. So once a source's reads have
completed, one more RMA get of the words of the blocks it read tells
whether they were held by its lease from the grant until after the data
landed: every word equal to ``word_tag(token, binding)`` of the params
held (the binding computed by this consumer) is a proof; anything else is
no proof, and the source is CONFIRMed as without words (``loads``).

The words land in a scratch array registered with the transport once per
worker (``CAPACITY`` words, 1 MiB), a word slot per block read; a check
that finds too few free slots (or a producer whose words do not cover the
blocks) is not made, and the source is CONFIRMed. The remote words are
prepared once per connection (``Connection.words_table``).

Imports numpy, the standard library and the connector's ``rdma.heldwords``,
``rdma.transport_api`` and the consumer's ``peers``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from rdma_kv.connector.rdma.heldwords import WORD_BYTES
from rdma_kv.connector.rdma.transport_api import DescList, PreparedList, TransferHandle, Transport
from rdma_kv.connector.rdma.consumer.peers import Connection

__all__ = ["CAPACITY", "WORDS_GRACE_S", "WordChecks"]

logger = logging.getLogger(__name__)

WORDS_GRACE_S = 0.0005
"""How much longer an idle step waits, once, for a held words' read posted
as its time ran out (``loads.RdmaConsumer.wait_idle``): one small RMA get,
whose load the engine's next step would otherwise report a step later."""

CAPACITY = 65536
"""Word slots of the scratch (16 bytes each): the blocks all checks in
flight may read at once."""


class WordChecks:
    """One consumer rank's word reads, through ``transport``."""

    def __init__(self, transport: Transport, capacity: int = CAPACITY) -> None:
        self._transport = transport
        self._array = np.zeros((capacity, WORD_BYTES), dtype=np.uint8)
        address = int(self._array.ctypes.data)
        transport.register((address, self._array.nbytes), memory_type="host")
        self._local = transport.prep_local(DescList.slots(address, capacity, WORD_BYTES))
        self._lock = threading.Lock()
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def free(self) -> int:
        """Word slots free (tests: every check gives its slots back)."""
        with self._lock:
            return len(self._free)

    def check(self, connection: Connection, block_ids: np.ndarray, tag: bytes, timeout_s: float,
              done: Callable[[bool], None]) -> TransferHandle | None:
        """Read the words of ``block_ids`` through ``connection``; later call
        ``done(True)`` (on any thread) if each names ``tag``, else
        ``done(False)``. Returns the words' read; None (and ``done`` never
        called) when no check was made: no free slots, no words, or posting
        failed. Call without the consumer's lock (this calls the transport)."""
        words = connection.words
        ids = np.unique(block_ids)
        if words is None or not ids.size or ids[0] < 0 or int(ids[-1]) >= words.nbytes // WORD_BYTES:
            return None
        n = int(ids.size)
        with self._lock:
            if len(self._free) < n:
                return None
            slots = self._free[-n:]
            del self._free[-n:]
        try:
            remote: PreparedList | None = connection.words_table
            if remote is None:  # (two threads may both prepare it: the same list, either kept)
                remote = connection.words_table = self._transport.prep_remote(
                    connection.name, DescList.slots(words.base_address, words.nbytes // WORD_BYTES, WORD_BYTES))
            local = np.asarray(slots, dtype=np.int64)
            self._array[local] = 0  # (what a slot held for an earlier check is no proof of this one)
            xfer = self._transport.read_prepared(self._local, local, remote, ids, timeout_s=timeout_s)
        except Exception as exc:
            logger.debug("reading held words through %s failed to post: %s", connection.name, exc)
            self._give_back(slots)
            return None
        expected = np.frombuffer(tag, dtype=np.uint8)

        def landed(handle: TransferHandle) -> None:
            ok = handle.error is None and bool((self._array[local] == expected).all())
            self._give_back(slots)
            done(ok)

        xfer.add_done_callback(landed)
        return xfer

    def _give_back(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)
