"""Descriptor lists, prepared-list indexing and coalescing; no UCX needed.

Coalescing is checked against a model: applying the merged operations to
byte arrays must give the same bytes as applying the original descriptors,
with exactly one operation per run that is contiguous on both sides and in
one region on each side.
"""

from __future__ import annotations

import numpy as np
import pytest

from rdma_kv.errors import DescriptorError
from rdma_kv.transport.descriptors import DescList, PreparedList, coalesce

U64 = np.uint64
U32 = np.uint32


def apply(dst: np.ndarray, src: np.ndarray, daddr, saddr, lengths) -> np.ndarray:
    """The bytes a batch moves, with addresses as offsets into dst / src."""
    out = dst.copy()
    for d, s, n in zip(daddr.tolist(), saddr.tolist(), lengths.tolist()):
        out[d:d + n] = src[s:s + n]
    return out


def expected_runs(laddr, raddr, lengths, lreg, rreg) -> int:
    runs = 1
    for i in range(1, len(laddr)):
        joined = (laddr[i] == laddr[i - 1] + lengths[i - 1] and raddr[i] == raddr[i - 1] + lengths[i - 1]
                  and lreg[i] == lreg[i - 1] and rreg[i] == rreg[i - 1])
        runs += not joined
    return runs


def shuffled_runs(rng: np.random.Generator, n: int) -> np.ndarray:
    """A permutation of range(n) made of shuffled ascending runs."""
    cuts = np.flatnonzero(rng.random(n - 1) < 0.3) + 1
    runs = np.split(np.arange(n), cuts)
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])


# -- coalesce --------------------------------------------------------------------


def test_coalesce_random_batches_move_the_same_bytes_with_fewer_ops(rng):
    for _ in range(50):
        n = int(rng.integers(2, 300))
        block = int(rng.integers(1, 64))
        per_region = int(rng.integers(1, n + 1))  # regions are adjacent in memory
        lslot = shuffled_runs(rng, n)
        rslot = shuffled_runs(rng, n) if rng.random() < 0.5 else lslot.copy()
        laddr = (lslot * block).astype(U64)
        raddr = (rslot * block).astype(U64)
        lengths = np.full(n, block, dtype=U64)
        lreg = (lslot // per_region).astype(U32)
        rreg = (rslot // per_region).astype(U32)
        src = rng.integers(0, 256, n * block, dtype=np.uint8)
        dst = np.zeros(n * block, dtype=np.uint8)

        m = coalesce(laddr, raddr, lengths, lreg, rreg)

        assert len(m[0]) == expected_runs(laddr, raddr, lengths, lreg, rreg) <= n
        assert int(m[2].sum()) == int(lengths.sum())
        region_bytes = U64(per_region * block)
        for addr, reg in ((m[0], m[3]), (m[1], m[4])):  # each op starts and ends in its own region
            assert np.array_equal(addr // region_bytes, reg)
            assert np.array_equal((addr + m[2] - U64(1)) // region_bytes, reg)
        assert np.array_equal(apply(dst, src, m[0], m[1], m[2]), apply(dst, src, laddr, raddr, lengths))


def test_coalesce_merges_fully_contiguous_batch_into_one_op():
    n, block = 64, 4096
    addrs = np.arange(n, dtype=U64) * U64(block)
    m = coalesce(addrs + U64(1 << 20), addrs + U64(7), np.full(n, block, dtype=U64),
                 np.zeros(n, U32), np.full(n, 3, U32))
    assert [a.tolist() for a in m] == [[1 << 20], [7], [n * block], [0], [3]]


def test_coalesce_merges_variable_lengths_and_keeps_order():
    lengths = np.array([3, 5, 8, 2], dtype=U64)
    laddr = np.array([100, 103, 108, 500], dtype=U64)
    raddr = np.array([0, 3, 8, 16], dtype=U64)  # contiguous throughout remotely
    zeros = np.zeros(4, U32)
    la, ra, ln, _, _ = coalesce(laddr, raddr, lengths, zeros, zeros)
    assert (la.tolist(), ra.tolist(), ln.tolist()) == ([100, 500], [0, 16], [16, 2])


def test_coalesce_never_merges_across_regions_even_when_adjacent():
    # Region 0 ends at 4096 where region 1 begins: contiguous addresses, two
    # registrations (two memory handles / remote keys): never one operation.
    laddr = np.array([0, 2048], dtype=U64)
    raddr = np.array([0, 2048], dtype=U64)
    lengths = np.full(2, 2048, dtype=U64)
    same = np.zeros(2, U32)
    split = np.array([0, 1], U32)
    assert len(coalesce(laddr, raddr, lengths, split, same)[0]) == 2
    assert len(coalesce(laddr, raddr, lengths, same, split)[0]) == 2
    assert len(coalesce(laddr, raddr, lengths, same, same)[0]) == 1


@pytest.mark.parametrize("side", ["local", "remote"])
def test_coalesce_needs_both_sides_contiguous(side):
    n, block = 8, 64
    contiguous = np.arange(n, dtype=U64) * U64(block)
    scattered = contiguous[::-1].copy()  # descending: never "starts where the last ended"
    laddr, raddr = (contiguous, scattered) if side == "local" else (scattered, contiguous)
    m = coalesce(laddr, raddr, np.full(n, block, dtype=U64), np.zeros(n, U32), np.zeros(n, U32))
    assert len(m[0]) == n
    assert np.array_equal(m[0], laddr) and np.array_equal(m[1], raddr)


def test_coalesce_does_not_merge_backwards_adjacency():
    # Descriptor 1 ends where descriptor 0 starts: adjacent, but in the wrong order.
    laddr = np.array([64, 0], dtype=U64)
    raddr = np.array([64, 0], dtype=U64)
    m = coalesce(laddr, raddr, np.full(2, 64, dtype=U64), np.zeros(2, U32), np.zeros(2, U32))
    assert len(m[0]) == 2


@pytest.mark.parametrize("n", [0, 1])
def test_coalesce_trivial_batches_pass_through(n):
    arrays = (np.arange(n, dtype=U64), np.arange(n, dtype=U64), np.ones(n, dtype=U64),
              np.zeros(n, U32), np.zeros(n, U32))
    for got, given in zip(coalesce(*arrays), arrays):
        assert np.array_equal(got, given)


# -- DescList --------------------------------------------------------------------------


def test_desclist_broadcasts_a_scalar_length_and_stores_uint64():
    d = DescList([10, 20, 30], 8)
    assert d.addrs.dtype == np.uint64 and d.lengths.dtype == np.uint64
    assert d.lengths.tolist() == [8, 8, 8]
    assert len(d) == 3 and d.nbytes == 24
    assert d.addrs.flags.c_contiguous


def test_desclist_from_regions_adds_offsets_to_base():
    d = DescList.from_regions(0x1000, np.array([0, 64, 128]), 64)
    assert d.addrs.tolist() == [0x1000, 0x1040, 0x1080]
    assert d.nbytes == 192


def test_desclist_slots_is_a_back_to_back_table():
    d = DescList.slots(0x1000, 3, 64)
    assert d.addrs.tolist() == [0x1000, 0x1040, 0x1080]
    assert d.lengths.tolist() == [64, 64, 64]
    assert len(DescList.slots(0x1000, 0, 64)) == 0
    with pytest.raises(DescriptorError, match="nbytes > 0"):
        DescList.slots(0x1000, 3, 0)


def test_empty_desclist_is_valid():
    assert len(DescList([], [])) == 0
    assert DescList(np.empty(0, dtype=np.uint64), 16).nbytes == 0


@pytest.mark.parametrize(
    ("addrs", "lengths", "message"),
    [
        ([[1, 2], [3, 4]], 8, "addrs must be one-dimensional"),
        ([1, 2], [[8, 8]], "lengths must be one-dimensional"),
        ([1.5, 2.0], 8, "addrs must be integers, got dtype float64"),
        ([1, 2], [8.0, 8.0], "lengths must be integers"),
        (["1", "2"], 8, "addrs must be integers"),
        ([True, False], 8, "addrs must be integers, got dtype bool"),
        ([-1, 2], 8, "addrs must be non-negative, got -1"),
        ([1, 2], [8, -8], "lengths must be non-negative, got -8"),
        ([1, 2, 3], [8, 8], "addrs has 3 entries but lengths has 2"),
    ],
)
def test_desclist_rejects_malformed_input(addrs, lengths, message):
    with pytest.raises(DescriptorError, match=message):
        DescList(addrs, lengths)


def test_descriptor_error_is_a_value_error():
    with pytest.raises(ValueError):
        DescList([-1], 1)


# -- PreparedList.take ---------------------------------------------------------


def prepared(n: int, peer: str | None = None) -> PreparedList:
    descs = DescList(np.arange(n, dtype=U64) * U64(16) + U64(0x1000), 16)
    return PreparedList(descs, np.arange(n, dtype=U32) % U32(2), peer, generation=1)


def test_take_gathers_by_index_in_the_given_order():
    addrs, lengths, regions = prepared(8).take([5, 0, 5, 7])
    assert addrs.tolist() == [0x1050, 0x1000, 0x1050, 0x1070]
    assert lengths.tolist() == [16] * 4
    assert regions.tolist() == [1, 0, 1, 1]


def test_take_accepts_an_empty_index():
    addrs, _, _ = prepared(4).take(np.empty(0, dtype=np.int64))
    assert len(addrs) == 0


@pytest.mark.parametrize(("index", "bad"), [([0, 8], 8), ([3, -1], -1), ([2**40], 2**40)])
def test_take_rejects_out_of_range_indices(index, bad):
    # A negative index must not wrap around the way numpy indexing would.
    with pytest.raises(DescriptorError, match=f"descriptor index {bad} out of range for a prepared list of 8 local"):
        prepared(8).take(index)


def test_take_names_the_peer_of_a_remote_list():
    with pytest.raises(DescriptorError, match=r"remote \(dec-0\) descriptors"):
        prepared(2, peer="dec-0").take([2])


@pytest.mark.parametrize("index", [[[0, 1]], [0.0, 1.0], [True, False], 3])
def test_take_rejects_non_integer_or_non_1d_indices(index):
    with pytest.raises(DescriptorError, match="descriptor index must be a 1-D integer array"):
        prepared(4).take(index)


def _prepared(addrs, lengths, regions, peer=None):
    from rdma_kv.transport.descriptors import PreparedList

    return PreparedList(DescList(addrs, lengths), np.asarray(regions, dtype=np.uint32), peer, 1)


def test_pair_indices_uniform_lists_need_no_per_descriptor_length_check():
    from rdma_kv.transport.descriptors import pair_indices

    local = _prepared(np.arange(8, dtype=np.uint64) * 64 + 4096, 64, [0] * 8)
    remote = _prepared(np.arange(8, dtype=np.uint64) * 64 + 8192, 64, [0] * 8, peer="p")
    assert local.uniform_length == 64 and local.single_region
    li, ri, nbytes = pair_indices(local, np.array([3, 4, 7], dtype=np.int32), remote, [0, 1, 2])
    assert li.dtype == np.int64 and ri.dtype == np.int64 and li.flags.c_contiguous
    assert list(li) == [3, 4, 7] and list(ri) == [0, 1, 2] and nbytes == 3 * 64


def test_pair_indices_general_path_checks_lengths_and_ranges():
    from rdma_kv.transport.descriptors import pair_indices

    local = _prepared([4096, 8192, 12288], [64, 128, 64], [0, 1, 1])
    remote = _prepared([4096, 8192, 12288], [64, 64, 64], [0, 0, 0], peer="p")
    assert local.uniform_length is None and not local.single_region and remote.single_region
    assert pair_indices(local, [0, 2], remote, [0, 1])[2] == 128
    with pytest.raises(DescriptorError, match="lengths differ"):
        pair_indices(local, [1], remote, [1])
    with pytest.raises(DescriptorError, match="out of range"):
        pair_indices(local, [-1], remote, [0])
    with pytest.raises(DescriptorError, match="pair up"):
        pair_indices(local, [0, 1], remote, [0])
