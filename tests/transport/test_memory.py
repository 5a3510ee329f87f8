"""What an object spans (``span_of``) and the vectorised descriptor check
(``RegionTable.locate``); no UCX needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rdma_kv.errors import DescriptorError, RegistrationError
from rdma_kv.transport.memory import MemoryKind, RegionTable, Span, span_of

# -- RegionTable.locate ------------------------------------------------------------

# Deliberately unsorted: locate() must answer with the caller's region indices.
SPANS = [(0x3000, 0x800), (0x1000, 0x1000)]


def locate(addrs, lengths, spans=SPANS):
    table = RegionTable(spans, "agent 't'")
    return table.locate(np.asarray(addrs, dtype=np.uint64), np.asarray(lengths, dtype=np.uint64), "local descriptors")


def test_locate_returns_the_callers_region_index():
    got = locate([0x1000, 0x3000, 0x1800, 0x37FF], [0x1000, 0x800, 0x10, 1])
    assert got.dtype == np.uint32
    assert got.tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize(
    ("addr", "length"),
    [
        (0x1000, 0x1000),  # exactly the first region
        (0x1FFF, 1),  # its last byte
        (0x3000, 0x800),  # exactly the second
        (0x37FF, 1),
    ],
)
def test_locate_accepts_exact_edges(addr, length):
    locate([addr], [length])


@pytest.mark.parametrize(
    ("addr", "length"),
    [
        (0x0FFF, 1),  # just before the first region
        (0x0FFF, 2),  # straddles its start
        (0x1FFF, 2),  # straddles its end
        (0x2000, 1),  # first byte after it, in the gap
        (0x1000, 0x2001),  # runs across the gap into the next region
        (0x3800, 1),  # just after the last region
        (0xFFFF_FFFF_FFFF_0000, 16),  # far after
        (0, 1),
        (0x1000, 2**63),  # length far past the region (no overflow in the check)
    ],
)
def test_locate_rejects_out_of_bounds(addr, length):
    with pytest.raises(DescriptorError, match="descriptor 1 .* is not inside any registered region"):
        locate([0x1000, addr], [16, length])


def test_locate_rejects_empty_descriptors():
    with pytest.raises(DescriptorError, match=r"descriptor 0 \[0x1000, \+0 bytes\) is empty"):
        locate([0x1000], [0])


def test_locate_error_says_what_was_checked_and_that_nothing_was_posted():
    with pytest.raises(DescriptorError) as exc:
        locate([0x1000, 0x1000, 0x9000], [8, 8, 8])
    msg = str(exc.value)
    assert msg.startswith("local descriptors: descriptor 2 [0x9000, +8 bytes)")
    assert "agent 't'" in msg and "[0x1000, 0x2000), [0x3000, 0x3800)" in msg
    assert "3 descriptors were checked and nothing was posted" in msg


def test_locate_never_spans_adjacent_regions():
    spans = [(0x1000, 0x1000), (0x2000, 0x1000)]
    assert locate([0x1FFF, 0x2000], [1, 1], spans).tolist() == [0, 1]
    with pytest.raises(DescriptorError):
        locate([0x1800], [0x1000], spans)


def test_locate_on_an_empty_table():
    assert locate([], [], spans=[]).tolist() == []
    with pytest.raises(DescriptorError, match="agent 't' has no registered memory"):
        locate([0x1000], [1], spans=[])


def test_locate_at_the_top_of_the_address_space():
    top = [(2**64 - 0x2000, 0x1000)]
    assert locate([2**64 - 0x1001], [1], top).tolist() == [0]
    for addr, length in [(2**64 - 0x1800, 0x1000), (2**64 - 0x1800, 2**64 - 1)]:  # addr + length wraps
        with pytest.raises(DescriptorError):
            locate([addr], [length], top)


def test_region_table_rejects_overlapping_spans():
    with pytest.raises(RegistrationError, match="registered regions overlap"):
        RegionTable([(0x1000, 0x1000), (0x1800, 0x1000)], "agent 't'")


def test_region_table_describe_truncates_long_lists():
    table = RegionTable([(0x1000 * (i + 1), 0x10) for i in range(6)], "peer 'p'")
    assert table.describe().endswith("and 2 more")


# -- span_of -------------------------------------------------------------------------


def test_torch_views_of_one_storage_share_one_span():
    kv = torch.zeros(4, 2, 16, 8)  # like vLLM's CPU KV cache: layers are views of one allocation
    whole = span_of(kv)
    assert whole == Span(kv.untyped_storage().data_ptr(), kv.nbytes, MemoryKind.HOST)
    views = [*kv.unbind(0), kv[1:3], kv[:, 1], kv.view(-1), kv.transpose(0, 3), kv[..., ::2], kv.view(torch.uint8)]
    assert {span_of(v) for v in views} == {whole}


def test_torch_tensor_sharing_numpy_memory_spans_the_array():
    arr = np.zeros(1024, dtype=np.float32)
    t = torch.from_numpy(arr)
    assert span_of(t) == Span(arr.ctypes.data, arr.nbytes, MemoryKind.HOST)


def test_torch_tensor_on_an_unsupported_device_is_rejected():
    with pytest.raises(RegistrationError, match="tensors on device meta cannot be registered"):
        span_of(torch.empty(16, device="meta"))


def test_numpy_views_resolve_to_the_owning_array():
    arr = np.zeros((64, 32), dtype=np.float32)
    whole = span_of(arr)
    assert whole == Span(arr.ctypes.data, arr.nbytes, MemoryKind.HOST)
    views = [arr[3:], arr[:, 5], arr.T, arr[::-1], arr.reshape(-1)[7:100], arr.view(np.uint8), arr[10:20][::2]]
    assert {span_of(v) for v in views} == {whole}


def test_numpy_array_over_foreign_memory_spans_its_own_bytes():
    raw = bytearray(4096)
    arr = np.frombuffer(raw, dtype=np.uint8)
    base = arr.ctypes.data
    assert span_of(arr[100:300]) == Span(base + 100, 200, MemoryKind.HOST)
    assert span_of(arr[100:300][::-1]) == Span(base + 100, 200, MemoryKind.HOST)
    assert span_of(arr.reshape(64, 64)[2:4, 8:16]) == Span(base + 2 * 64 + 8, 64 + 8, MemoryKind.HOST)


def test_address_and_size_pair():
    assert span_of((0x7F00_0000_1000, 4096)) == Span(0x7F00_0000_1000, 4096, None)


@pytest.mark.parametrize("obj", [[0x1000, 16], "buffer", b"bytes", (0x1000, 16, 0), (4096.0, 16), object()])
def test_unsupported_objects_are_rejected(obj):
    with pytest.raises(RegistrationError, match=f"cannot register {type(obj).__name__}: pass a torch tensor"):
        span_of(obj)


@pytest.mark.parametrize("pair", [(0, 16), (-4096, 16), (0x1000, 0), (0x1000, -1), (2**64 - 8, 16), (2**64 - 16, 16)])
def test_invalid_address_ranges_are_rejected(pair):
    with pytest.raises(RegistrationError, match="address and size must be positive"):
        span_of(pair)


def test_empty_numpy_array_is_rejected():
    with pytest.raises(RegistrationError):
        span_of(np.zeros(0, dtype=np.uint8))


def test_span_of_accepts_numpy_integers_in_address_tuple():
    from rdma_kv.transport.memory import span_of

    span = span_of((np.uint64(0x10000), np.int64(4096)))
    assert (span.base, span.nbytes, span.kind) == (0x10000, 4096, None)
    assert type(span.base) is int and type(span.nbytes) is int
