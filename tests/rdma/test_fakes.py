"""The fake transport (``fakes.py``) behaves as the agent where the
connector's tests rely on it: an import removed or replaced fails what was
held in flight through it (canceled, no notification; its bytes may still
land, as over TCP: removing one's own import is no fence, only the
target's fence is), a list prepared for it is refused afterwards, and a
flush is of one import, not of every import of the same agent (reviews
found each of these missing, and a fake that landed nothing)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeFabric

from rdma_kv.errors import DescriptorError, PeerError, TransferError
from rdma_kv.transport.descriptors import DescList

NBYTES = 64


def writer_and_target():
    fabric = FakeFabric()
    p, d = fabric.factory("P"), fabric.factory("D")
    src, dst = np.ones(NBYTES, np.uint8), np.zeros(NBYTES, np.uint8)
    p.register((src.ctypes.data, NBYTES))
    d.register((dst.ctypes.data, NBYTES))
    local = p.prep_local(DescList.slots(src.ctypes.data, 1, NBYTES))
    return fabric, p, d, dst, local


@pytest.mark.parametrize("how", ["fenced", "removed", "replaced"])
def test_an_import_gone_fails_its_writes_in_flight_and_notifies_no_one(how):
    fabric, p, d, dst, local = writer_and_target()
    name = p.add_peer(d.metadata(), name="D#x/1", paired=True)
    remote = p.prep_remote(name, DescList.slots(dst.ctypes.data, 1, NBYTES))
    fabric.hold = True
    held = p.write_prepared(local, [0], remote, [0], notify=b"push-token")
    if how == "replaced":
        p.add_peer(d.metadata(), name=name, paired=True)
    else:
        p.remove_peer(name, fence=how == "fenced")
    fabric.release_all()
    assert isinstance(held.error, TransferError) and held.abandoned and not d.inbox and not dst.any()
    fabric.land_late()
    assert dst.all() and not d.inbox  # its bytes landed later all the same (real UCX over TCP: all 32 MiB)
    expected = DescriptorError if how == "replaced" else PeerError
    with pytest.raises(expected):  # the list prepared for the import that is gone
        p.write_prepared(local, [0], remote, [0])


def test_a_flush_waits_for_its_own_imports_writes_only():
    fabric, p, d, dst, local = writer_and_target()
    old = p.add_peer(d.metadata(), name="D#x/1", paired=True)
    new = p.add_peer(d.metadata(), name="D#x/2", paired=True)
    fabric.hold = True
    held = p.write_prepared(local, [0], p.prep_remote(old, DescList.slots(dst.ctypes.data, 1, NBYTES)), [0])
    assert p.flush(new).done() and not held.done()  # another endpoint: UCX's flush of it says nothing of this one
    flush = p.flush(old, notify=b"sealed")
    assert not flush.done()
    fabric.release_all()
    assert held.error is None and flush.error is None and dst.all()
    assert [n.payload for n in d.get_notifications()] == [b"sealed"]
    with pytest.raises(PeerError):
        p.flush("D#x/3")  # never imported
