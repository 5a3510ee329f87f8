"""Held words: one 16-byte word per KV block that names the lease holding it, read one-sided.

Owns :class:`HeldWords` (the producer's array, registered with the
transport next to the KV cache) and :func:`word_tag` (what a word holds
for one lease, computed alike on both ends).

Why. Validate-after-read needs the producer to vouch that a lease was held
while its blocks were read. A PIN or a CONFIRM does it with a round trip
through the producer's side channel (Python, on the producer's CPU): on a
small prompt that round trip is most of the load's time. A held word does
it with one more RMA get after the data, which the producer's CPU takes
no part in:

- The producer's worker writes ``word_tag(token, binding)`` into the word
  of every block of a lease when the lease's grant reaches it, and, when
  the lease ends, writes something else there (zero, or the tag of another
  live lease holding that block) *before* the request goes to
  ``done_sending``, the only way its blocks go back to the engine.
- The consumer reads its blocks, waits for those reads to complete, then
  reads the words of the blocks it read. If every word holds the tag of
  its lease, the lease was live when the words were read, hence from its
  grant (before its params existed) until after the data had landed: no
  block was reused under the reads. A tag is never written again once its
  lease ended (a lease never comes back), so there is no ABA.
- Anything else (zero: not granted yet, ended, or asleep; another tag: a
  block shared by two leases, a prefix hit, whose word names the other;
  a torn read of a word being rewritten) is not a refusal, only no proof:
  the consumer CONFIRMs, as without words.

What a tag binds. ``word_tag`` is a hash of the grant ``token`` and the
lease's ``binding`` (engine, TP size, token count, registration, every
group's block ids, the prompt's digest: ``params.lease_binding``). The
consumer computes it from the params it holds and its own request's
prompt, so params edited to name other blocks (another request's), other
positions of the lease's own blocks, or KV of another prompt produce
another tag and fall back to the CONFIRM, which answers FORGED. The token
is the secret part (an HMAC under the producer's key): a client holding
one lease's params cannot make the tag of another's. Words are readable
by every peer holding the remote key, as the KV cache itself is; a tag
reveals neither the token nor the binding.

What it does not decide: the claim. A word proves the data, not who owns
the lease; RENEW and RELEASE still carry the claim, and the first claim
still owns the lease's renewals and releases (``leases``).

Imports numpy, the standard library and the connector's ``rdma.wiregeom``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from rdma_kv.connector.rdma.wiregeom import RegionWire

__all__ = ["WORD_BYTES", "HeldWords", "checked_words", "word_tag"]

WORD_BYTES = 16
"""Bytes per block's word: a 128-bit tag (two 8-byte stores; a torn read
matches no tag, so it only costs a CONFIRM)."""

_PERSON = b"rdma-kv held wor"
"""blake2b's personalization, 16 bytes at most: the tags' since protocol 12
(it was spelled "rdma-kv held word 1" and cut to these 16, so a "2" there
changed nothing; a new tag scheme changes these bytes)."""


def word_tag(token: bytes, binding: bytes) -> bytes:
    """What a block's word holds while the lease of grant ``token`` over
    ``binding`` holds it: never all zero (zero means "held by nothing")."""
    tag = hashlib.blake2b(token + binding, digest_size=WORD_BYTES, person=_PERSON).digest()
    return tag if any(tag) else b"\x01" + tag[1:]


def checked_words(words: RegionWire | None, num_blocks: int) -> RegionWire | None:
    """A producer's words as its handshake reply names them, cut to one
    word per block of its geometry (a consumer prepares a descriptor per
    word: a producer claiming 2^30 of them made it build 16 GiB of lists), or
    None (not published, or fewer words than blocks: its sources are then
    CONFIRMed)."""
    if words is None or words.nbytes % WORD_BYTES or words.nbytes // WORD_BYTES < num_blocks:
        return None
    return RegionWire(words.base_address, num_blocks * WORD_BYTES)


class HeldWords:
    """The words of one producer rank's ``num_blocks`` blocks (zero: held by
    no lease). Not thread-safe: the lease table calls it under its lock."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"held words need at least one block, got {num_blocks}")
        self.array = np.zeros((num_blocks, WORD_BYTES), dtype=np.uint8)
        """The registered memory: row ``b`` is block ``b``'s word."""
        self._others: dict[int, dict[bytes, None]] = {}
        """Per block shared by several live leases: the tags of those its word
        does not name, in the order they came (a dict: a lease's end costs its
        blocks, not its blocks times the leases that share them)."""

    @property
    def num_blocks(self) -> int:
        return int(self.array.shape[0])

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def _ids(self, block_ids: Iterable[int]) -> np.ndarray:
        ids = np.unique(np.fromiter(block_ids, dtype=np.int64))
        return ids[(ids >= 0) & (ids < self.num_blocks)]  # (the engine's ids: out of range is never read)

    def hold_lease(self, token: bytes, binding: bytes, groups: Iterable[Iterable[int]]) -> None:
        """The lease of grant ``token`` over ``binding`` now holds the blocks of ``groups``."""
        self.hold(word_tag(token, binding), (b for group in groups for b in group))

    def drop_lease(self, token: bytes, binding: bytes, groups: Iterable[Iterable[int]]) -> None:
        """That lease ended: no word names it any more when this returns."""
        self.drop(word_tag(token, binding), (b for group in groups for b in group))

    def hold(self, tag: bytes, block_ids: Iterable[int]) -> None:
        """A lease of ``tag`` now holds ``block_ids``."""
        ids, word = self._ids(block_ids), np.frombuffer(tag, dtype=np.uint8)
        if not ids.size:
            return
        free = ~self.array[ids].any(axis=1)
        self.array[ids[free]] = word
        for b in ids[~free].tolist():  # a shared prefix: its word names another live lease already
            self._others.setdefault(b, {})[tag] = None

    def drop(self, tag: bytes, block_ids: Iterable[int]) -> None:
        """The lease of ``tag`` ended: no word names it any more when this returns."""
        ids, word = self._ids(block_ids), np.frombuffer(tag, dtype=np.uint8)
        if not ids.size:
            return
        named = (self.array[ids] == word).all(axis=1)
        shared = np.fromiter((b in self._others for b in ids.tolist()), dtype=bool, count=ids.size)
        self.array[ids[named & ~shared]] = 0
        for b, names in zip(ids[shared].tolist(), named[shared].tolist()):
            others = self._others[b]
            if names:  # hand the word to another live holder (one store): it holds the block too
                self.array[b] = np.frombuffer(others.popitem()[0], dtype=np.uint8)
            else:
                others.pop(tag, None)
            if not others:
                del self._others[b]

    def clear(self) -> None:
        """Every lease ended (a new epoch, sleep)."""
        self.array[:] = 0
        self._others.clear()

    def held(self) -> int:
        """Blocks whose word names a lease (tests, leak checks)."""
        return int(self.array.any(axis=1).sum())
