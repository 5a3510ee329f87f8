"""Agent metadata on the wire: round trip, and every way a peer's blob can be
wrong -> ``MetadataError`` (a ``ValueError``) with a message that says what.

Synthetic blobs need no UCX; the tests marked ``ucx`` use a real agent's.
"""

from __future__ import annotations

import msgspec
import pytest

from rdma_kv.errors import MetadataError, PeerError
from rdma_kv.transport import metadata as wire
from rdma_kv.transport.memory import MemoryKind

REGIONS = [
    wire.RegionInfo(0x7F00_0000_0000, 1 << 20, MemoryKind.HOST, b"\x01rkey-a"),
    wire.RegionInfo(0x7F00_0020_0000, 4096, MemoryKind.HOST, b"\x02rkey-b"),
]


def blob(**changes) -> bytes:
    md = msgspec.msgpack.decode(wire.encode("peer", "1.22.0", b"worker-address", REGIONS), type=wire.AgentMetadata)
    return msgspec.msgpack.encode(msgspec.structs.replace(md, **changes))


def raw(fields: dict) -> bytes:
    """A msgpack map with arbitrary fields, as another build might send."""
    return msgspec.msgpack.encode({**fields_of(blob()), **fields})


def fields_of(data: bytes) -> dict:
    return msgspec.structs.asdict(msgspec.msgpack.decode(data, type=wire.AgentMetadata))


def test_round_trip():
    md = wire.decode(blob())
    assert (md.magic, md.version, md.schema) == (wire.MAGIC, wire.VERSION, wire.SCHEMA)
    assert (md.name, md.ucx_version, md.worker_address) == ("peer", "1.22.0", b"worker-address")
    assert md.regions == REGIONS


@pytest.mark.parametrize("wrap", [bytearray, memoryview])
def test_bytes_like_input_is_accepted(wrap):
    assert wire.decode(wrap(blob())).name == "peer"


def test_every_truncation_of_a_blob_is_rejected():
    good = blob()
    for k in range(len(good)):
        with pytest.raises(MetadataError, match=rf"malformed or truncated agent metadata \({k} bytes\)"):
            wire.decode(good[:k])


@pytest.mark.parametrize(
    "bad",
    [b"", b"\xc1", b"\xff" * 64, b'{"magic": "rdma-kv/agent"}', msgspec.msgpack.encode([1, 2, 3])],
)
def test_garbage_is_rejected(bad):
    with pytest.raises(MetadataError, match="pass the exact bytes the peer's Agent.metadata"):
        wire.decode(bad)


def test_non_bytes_are_rejected():
    with pytest.raises(MetadataError, match="agent metadata must be bytes, got str"):
        wire.decode("rdma-kv/agent")  # type: ignore[arg-type]


def test_oversized_blob_is_rejected_before_parsing():
    with pytest.raises(MetadataError, match=f"over the {wire.MAX_METADATA_BYTES}-byte limit"):
        wire.decode(b"\x00" * (wire.MAX_METADATA_BYTES + 1))


def test_wrong_magic():
    with pytest.raises(MetadataError, match=r"not rdma-kv agent metadata \(magic 'nixl-agent', expected 'rdma-kv/"):
        wire.decode(blob(magic="nixl-agent"))


def test_wrong_version():
    want = f"from 'peer': version 2 schema {wire.SCHEMA}, this agent speaks version {wire.VERSION}"
    with pytest.raises(MetadataError, match=want):
        wire.decode(blob(version=2))


def test_wrong_schema():
    with pytest.raises(MetadataError, match="schema 0{16}, this agent speaks .* run the same rdma-kv release"):
        wire.decode(blob(schema="0" * 16))


def test_a_newer_layout_is_reported_as_incompatible_not_malformed():
    # A later release that adds a field (and bumps version and schema) must get
    # the version message, not "malformed".
    newer = raw({"version": 2, "schema": "f" * 16, "auth_tag": b"\x00" * 32})
    with pytest.raises(MetadataError, match="incompatible agent metadata from 'peer': version 2"):
        wire.decode(newer)


@pytest.mark.parametrize(
    "fields",
    [
        {"extra": 1},  # unknown field at the current version
        {"name": ""},
        {"name": "x" * (wire.MAX_NAME_BYTES + 1)},
        {"worker_address": b""},
        {"regions": [[0x1000, 0, "host", b"k"]]},  # empty region
        {"regions": [[-1, 16, "host", b"k"]]},
        {"regions": [[0x1000, 16, "nvme", b"k"]]},  # unknown memory kind
        {"regions": [[0x1000, 16, "host", b""]]},  # empty remote key
        {"regions": [[0x1000, 16, "host"]]},
        {"regions": "none"},
    ],
)
def test_malformed_fields_are_rejected(fields):
    with pytest.raises(MetadataError, match="malformed or truncated agent metadata"):
        wire.decode(raw(fields))


def test_missing_field_is_rejected():
    fields = fields_of(blob())
    del fields["worker_address"]
    with pytest.raises(MetadataError, match="worker_address"):
        wire.decode(msgspec.msgpack.encode(fields))


def test_overlapping_regions_are_rejected():
    regions = [*REGIONS, wire.RegionInfo(0x7F00_0000_8000, 16, MemoryKind.HOST, b"k")]
    want = r"from 'peer' lists overlapping regions \[0x7f0000000000, 0x7f0000100000\) and \[0x7f0000008000, "
    with pytest.raises(MetadataError, match=want):
        wire.decode(blob(regions=regions))


def test_adjacent_regions_are_fine():
    regions = [wire.RegionInfo(0x1000, 0x1000, MemoryKind.HOST, b"a"),
               wire.RegionInfo(0x2000, 16, MemoryKind.HOST, b"b")]
    assert len(wire.decode(blob(regions=regions)).regions) == 2


@pytest.mark.parametrize("base", [2**64 - 16, 2**64 - 8])
def test_region_past_the_address_space_is_rejected(base):
    with pytest.raises(MetadataError, match="past the 64-bit address space"):
        wire.decode(blob(regions=[wire.RegionInfo(base, 16, MemoryKind.HOST, b"k")]))


def test_too_many_regions_are_rejected():
    regions = [[0x1000 + 16 * i, 16, "host", b"k"] for i in range(wire.MAX_REGIONS + 1)]
    with pytest.raises(MetadataError, match="malformed or truncated"):
        wire.decode(raw({"regions": regions}))


def test_metadata_error_is_a_value_error():
    with pytest.raises(ValueError):
        wire.decode(b"")


# -- a real agent's metadata ------------------------------------------------------------


@pytest.mark.ucx
def test_real_metadata_round_trips_and_every_truncation_fails(make_agent):
    import numpy as np

    agent = make_agent("meta")
    buf = np.zeros(1 << 16, dtype=np.uint8)
    region = agent.register(buf)
    good = agent.metadata()
    md = wire.decode(good)
    assert md.name == "meta" and md.worker_address
    assert [(r.base, r.nbytes, r.kind) for r in md.regions] == [(buf.ctypes.data, buf.nbytes, MemoryKind.HOST)]
    assert md.regions[0].rkey == region.packed_rkey
    for k in range(len(good)):
        with pytest.raises(MetadataError, match="malformed or truncated"):
            wire.decode(good[:k])


@pytest.mark.ucx
def test_add_peer_rejects_bad_metadata_and_keeps_its_peers(make_agent):
    a = make_agent("a")
    b = make_agent("b")
    good = b.metadata()
    a.add_peer(good)
    for bad in (good[:-1], good[:10], b"", good + b"\x00"):
        with pytest.raises(MetadataError):
            a.add_peer(bad)
    assert a.peers == ("b",)
    with pytest.raises(PeerError, match="metadata names this agent itself"):
        a.add_peer(a.metadata())


def test_a_peer_imported_under_the_name_its_importer_knows_it_by(make_agent):
    """Two agents whose metadata give one name (two producers that claim
    one engine id) imported under names of the importer's: both live, and
    each name reads its own agent's memory; a name is still not the
    importer's own."""
    import numpy as np

    from rdma_kv.transport import DescList

    twins = [make_agent("p"), make_agent("p")]
    bufs = [np.full(4096, k + 1, dtype=np.uint8) for k in range(2)]
    for twin, buf in zip(twins, bufs):
        twin.register(buf)
    d = make_agent("d")
    assert [d.add_peer(t.metadata(), name=f"p@{k}") for k, t in enumerate(twins)] == ["p@0", "p@1"]
    assert sorted(d.peers) == ["p@0", "p@1"]
    out = np.zeros(4096, dtype=np.uint8)
    d.register(out)
    for k, buf in enumerate(bufs):
        d.read(f"p@{k}", DescList([out.ctypes.data], 4096), DescList([buf.ctypes.data], 4096)).wait(10)
        assert (out == k + 1).all()
    for bad in ("d", ""):
        with pytest.raises(PeerError, match="cannot import a peer as"):
            d.add_peer(twins[0].metadata(), name=bad)
    assert sorted(d.peers) == ["p@0", "p@1"]
    d.close()
    for twin in twins:  # both before the fixture's check, which tells agents apart by name
        twin.close()
