"""Held words, the consumer's side: read a source's words right behind its data, and say whether they vouch for it.

Owns :class:`WordChecks` and :class:`WordCheck`. A producer that publishes
held words (``heldwords``; the handshake reply's ``words``) names, in one
16-byte word per block, the live lease that holds the block, and changes
the word before the block can go back to its engine. So once a source's
reads have completed, one more RMA get of the words of the blocks it read
tells whether they were held by its lease from the grant until after the
data landed: every word equal to ``word_tag(token, binding)`` of the
params held (the binding computed by this consumer) is a proof; anything
else is no proof, and the source is CONFIRMed as without words (``loads``).

The words' read is *chained* behind the source's reads
(``transport_api.ChainedRead``): prepared with them, posted by the
transport's shim as their last operation completes, on the thread that
completed it, so that it starts a wire round trip after the data landed
with no Python in between; the source's transfer completes once it does.

The words land in a scratch array registered with the transport once per
worker (``CAPACITY`` words, 1 MiB), a word slot per block read, taken in
chunks of ``CHUNK`` contiguous slots; a source that finds too few free
slots is read without its words, and CONFIRMed. The remote words are
prepared once per connection (``Connection.words_table``).

Imports numpy, the standard library and the connector's ``rdma.heldwords``,
``rdma.transport_api`` and the consumer's ``peers``.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from rdma_kv.connector.rdma.heldwords import WORD_BYTES
from rdma_kv.connector.rdma.transport_api import ChainedRead, DescList, PreparedList, Transport
from rdma_kv.connector.rdma.consumer.peers import Connection

__all__ = ["CAPACITY", "CHUNK", "WORDS_GRACE_S", "WordCheck", "WordChecks"]

logger = logging.getLogger(__name__)

WORDS_GRACE_S = 0.0005
"""How much longer an idle step waits, once, for reads with their held
words' read chained behind them still in flight as its time ran out
(``loads.RdmaConsumer.wait_idle``): landed, their words are one small RMA
get away, and the engine's next step would report their load a step
later."""

CAPACITY = 65536
"""Word slots of the scratch (16 bytes each): the blocks all checks in
flight may read at once."""

CHUNK = 16
"""Word slots a check takes at a time, contiguous: a check of up to this
many blocks (a 128-token prompt's share of a rank: 4-8 blocks) is one
chunk, zeroed and compared as one slice."""


class WordCheck:
    """One source's held words' read: its chunks of word slots, its slots
    (``local``, a view when one chunk), the bytes they must hold once read
    (the tag, once per block) and the read to chain behind the source's
    reads (``then``)."""

    __slots__ = ("chunks", "local", "expected", "then")

    def __init__(self, chunks: list[int], local: np.ndarray, expected: bytes, then: ChainedRead) -> None:
        self.chunks, self.local, self.expected, self.then = chunks, local, expected, then


class WordChecks:
    """One consumer rank's word reads, through ``transport``."""

    def __init__(self, transport: Transport, capacity: int = CAPACITY) -> None:
        self._transport = transport
        capacity -= capacity % CHUNK
        self._array = np.zeros((capacity, WORD_BYTES), dtype=np.uint8)
        address = int(self._array.ctypes.data)
        transport.register((address, self._array.nbytes), memory_type="host")
        self._local = transport.prep_local(DescList.slots(address, capacity, WORD_BYTES))
        self._slots = np.arange(capacity, dtype=np.int64).reshape(-1, CHUNK)  # chunk -> its slots
        self._lock = threading.Lock()
        self._free = list(range(capacity // CHUNK - 1, -1, -1))  # free chunks
        self.quarantined = 0
        """Word slots never given back: their check's transfer failed while
        its chained read could still land in them (``verify``)."""

    @property
    def free(self) -> int:
        """Word slots free (tests: every check gives its slots back)."""
        with self._lock:
            return len(self._free) * CHUNK

    def prepare(self, connection: Connection, block_ids: np.ndarray, tag: bytes) -> WordCheck | None:
        """The read of the words of ``block_ids`` (the producer's, each in
        its KV cache's range, which covers its words: ``checked_words``)
        through ``connection``, to chain behind the reads of those blocks;
        None (nothing held) when no check can be made: no words, or too few
        free slots. Give it back with :meth:`verify`, once the transfer it
        was chained behind completed (or was never posted). Call without
        the consumer's lock (this may call the transport). Written for a
        cold cache, as the post it precedes."""
        words, n = connection.words, len(block_ids)
        if words is None or not n:
            return None
        k = -(-n // CHUNK)
        with self._lock:
            if len(self._free) < k:
                return None
            chunks = self._free[-k:]
            del self._free[-k:]
        remote: PreparedList | None = connection.words_table
        if remote is None:  # (two threads may both prepare it: the same list, either kept)
            try:
                remote = connection.words_table = self._transport.prep_remote(
                    connection.name, DescList.slots(words.base_address, words.nbytes // WORD_BYTES, WORD_BYTES))
            except Exception as exc:
                logger.debug("preparing the held words of %s failed: %s", connection.name, exc)
                self._give_back(chunks)
                return None
        if k == 1:
            first = chunks[0] * CHUNK
            local = self._slots[chunks[0], :n]
            self._array[first:first + n] = 0  # (what a slot held for an earlier check is no proof of this one)
        else:
            local = self._slots[chunks].ravel()[:n]
            self._array[local] = 0
        return WordCheck(chunks, local, tag * n, ChainedRead(self._local, local, remote, block_ids))

    def verify(self, check: WordCheck, landed: bool, may_land_later: bool = False) -> bool:
        """Whether the words ``check`` read each name its tag (False unless
        they ``landed``); its slots are free again, unless ``may_land_later``.

        ``may_land_later``: the transfer it was chained behind failed without
        completing in the transport (``TransferHandle.abandoned``: at its
        deadline, UCX did not cancel it; or a close), so its chained read
        may be on the wire, or be posted in the instant the abandon races
        the completion, and land later. Its slots are then
        kept out of use for good (``quarantined``): given to a later check,
        those late words would be compared as that check's, and a later
        check of the same lease (another producer rank's source of the
        load, posted once its handshake ends) expects the same tag. Failed
        transfers are rare and a slot is 16 bytes; with none free, sources
        are CONFIRMed."""
        chunks = check.chunks
        if not landed:
            ok = False
            if may_land_later:  # (only a read that did not land may land later)
                with self._lock:
                    self.quarantined += len(chunks) * CHUNK
                return False
        elif len(chunks) == 1:
            first = chunks[0] * CHUNK
            ok = self._array[first:first + len(check.local)].tobytes() == check.expected
        else:
            ok = self._array[check.local].tobytes() == check.expected
        self._give_back(chunks)
        return ok

    def _give_back(self, chunks: list[int]) -> None:
        with self._lock:
            self._free.extend(chunks)
