"""The consumer's word checks (``consumer/words.py``) on their own: the word
slots a check takes (in chunks of ``CHUNK`` contiguous slots), the read it
chains behind a source's reads, what it accepts once the words landed, and
that every slot comes back. The words' meaning and the consumer around
them: ``test_held_words.py``; the chained read itself over UCX:
``tests/transport/test_chained_read.py``."""

from __future__ import annotations

import types

import numpy as np
import pytest

from rdma_kv.connector.rdma.consumer.words import CHUNK, WordChecks
from rdma_kv.connector.rdma.heldwords import WORD_BYTES, word_tag
from rdma_kv.connector.rdma.transport_api import ChainedRead
from rdma_kv.connector.rdma.wiregeom import RegionWire

TAG = word_tag(b"t" * 16, b"b" * 16)
NUM_BLOCKS = 512


class Lists:
    """Just what WordChecks asks of a transport: it registers its scratch and
    prepares both sides' lists (here: the DescLists themselves)."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.remote_preps = 0

    def register(self, obj, *, memory_type=None):
        self.registered.append(obj)
        return obj

    def prep_local(self, descs):
        return descs

    def prep_remote(self, peer, descs):
        self.remote_preps += 1
        return descs


def connection():
    return types.SimpleNamespace(name="P/tp0", words=RegionWire(0x10000, NUM_BLOCKS * WORD_BYTES), words_table=None)


def land(checks: WordChecks, then: ChainedRead, words: bytes) -> None:
    """What the chained read does: word i of the producer into slot local_index[i]."""
    for slot, i in zip(np.asarray(then.local_index).tolist(), range(len(then.remote_index))):
        checks._array[slot] = np.frombuffer(words[i * WORD_BYTES:(i + 1) * WORD_BYTES], dtype=np.uint8)


@pytest.mark.parametrize("n", [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_a_check_reads_one_word_per_block_into_slots_of_its_own_and_gives_them_back(n):
    lists = Lists()
    checks = WordChecks(lists, capacity=64 * CHUNK)
    conn = connection()
    checks._array[:] = 0xEE  # what earlier checks left: no proof of this one
    ids = np.arange(n, dtype=np.int64) * 3 + 5
    check = checks.prepare(conn, ids, TAG)
    then = check.then
    assert isinstance(then, ChainedRead) and then.remote is conn.words_table and then.local is checks._local
    assert np.array_equal(then.remote_index, ids)
    slots = np.asarray(then.local_index)
    assert len(slots) == n and len(set(slots.tolist())) == n
    assert np.diff(slots[:CHUNK]).tolist() == [1] * (min(n, CHUNK) - 1)  # a chunk is contiguous
    assert not checks._array[slots].any(), "the slots were not zeroed"
    assert checks.free == 64 * CHUNK - (-(-n // CHUNK)) * CHUNK
    land(checks, then, TAG * n)
    assert checks.verify(check, landed=True)
    assert checks.free == 64 * CHUNK
    assert lists.remote_preps == 1


@pytest.mark.parametrize("n", [1, CHUNK + 3])
def test_any_word_not_naming_the_lease_or_a_read_that_did_not_land_is_no_proof(n):
    checks = WordChecks(Lists(), capacity=8 * CHUNK)
    conn = connection()
    other = word_tag(b"u" * 16, b"b" * 16)
    for words, landed in ((TAG * (n - 1) + other, True), (TAG * (n - 1) + bytes(WORD_BYTES), True),
                          (TAG * (n - 1) + TAG[:8] + other[8:], True), (TAG * n, False)):
        check = checks.prepare(conn, np.arange(n, dtype=np.int64), TAG)
        land(checks, check.then, words)
        assert not checks.verify(check, landed=landed)
        assert checks.free == 8 * CHUNK
    assert checks.prepare(conn, np.arange(n, dtype=np.int64), TAG) is not None


def test_no_free_slots_or_no_words_means_no_check_and_nothing_held():
    checks = WordChecks(Lists(), capacity=4 * CHUNK)
    conn = connection()
    assert checks.prepare(conn, np.arange(4 * CHUNK + 1, dtype=np.int64), TAG) is None  # more than it has
    held = [checks.prepare(conn, np.arange(1, dtype=np.int64), TAG) for _ in range(4)]  # a chunk each
    assert all(h is not None for h in held) and checks.free == 0
    assert checks.prepare(conn, np.arange(1, dtype=np.int64), TAG) is None
    for h in held:
        checks.verify(h, landed=False)
    assert checks.free == 4 * CHUNK
    assert checks.prepare(types.SimpleNamespace(name="P", words=None, words_table=None),
                          np.arange(3, dtype=np.int64), TAG) is None
    assert checks.prepare(conn, np.zeros(0, dtype=np.int64), TAG) is None
    assert checks.free == 4 * CHUNK


def test_the_remote_words_prepared_once_a_failure_holds_nothing():
    class Refusing(Lists):
        def prep_remote(self, peer, descs):
            raise RuntimeError("peer gone")

    checks = WordChecks(Refusing(), capacity=4 * CHUNK)
    assert checks.prepare(connection(), np.arange(3, dtype=np.int64), TAG) is None
    assert checks.free == 4 * CHUNK


def test_slots_whose_read_may_land_later_are_never_given_out_again():
    """A check whose transfer was abandoned keeps its slots out of use: the
    late words of its lease could pass for a later check's of the same tag."""
    checks = WordChecks(Lists(), capacity=4 * CHUNK)
    conn = connection()
    gone = checks.prepare(conn, np.arange(CHUNK + 1, dtype=np.int64), TAG)  # two chunks
    assert not checks.verify(gone, landed=False, may_land_later=True)
    assert checks.quarantined == 2 * CHUNK and checks.free == 2 * CHUNK
    kept = set(np.asarray(gone.then.local_index).tolist())
    later = [checks.prepare(conn, np.arange(1, dtype=np.int64), TAG) for _ in range(2)]
    assert all(c is not None for c in later) and checks.free == 0
    assert checks.prepare(conn, np.arange(1, dtype=np.int64), TAG) is None  # (then: CONFIRMed)
    assert not kept & {s for c in later for s in np.asarray(c.then.local_index).tolist()}
    for c in later:
        land(checks, c.then, TAG)
        assert checks.verify(c, landed=True, may_land_later=True)  # (landed: nothing is still coming)
    assert checks.free == 2 * CHUNK and checks.quarantined == 2 * CHUNK
