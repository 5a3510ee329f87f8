"""A fence against a peer's writes: ``Agent.remove_peer(name, fence=True)``.

A writer's transfer that passed its deadline while its target hung fails
on the writer's side, but UCX may still hold it (a flush of the endpoint
outstanding: the transport *abandons* it, ``Transfer.abandoned``), its
bytes queued in UCX and the kernel. When the target runs again, its worker
applies them. Push mode's decode hands a failed push's blocks back to its
engine; before that it must make sure nothing more of the producer's lands
there. A graceful close of its endpoints is no such fence: over TCP, UCX
keeps the connection the writer's own endpoint writes through, and the
rest of the write went on landing after the close returned (64 MiB: 4.2 MiB
had landed when it returned, all of it 3 s later). A forced close is, of
the connection UCX paired with the target's endpoint: the writer's
endpoint on its own worker, when both sides imported each other
``paired`` (``Agent.add_peer``). A lane's endpoint pairs with none of the
target's, and what it carries lands after any fence of the target's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from transport_helpers import TCP, wait_until

from rdma_kv.errors import TransferError
from rdma_kv.transport import DescList

pytestmark = [pytest.mark.ucx]

NBYTES = 32 << 20  # big enough that the writer is still sending when the target runs again
FILL = 0xAB


def abandoned_write(make_agent, lanes=1, paired=False, dials=1, ordinal=False):
    """A target (polling; the test progresses it) and a writer (its progress
    thread, deadline 1 s) whose notified write of ``NBYTES`` failed at its
    deadline while the target did not progress: the writer's transport
    abandoned it (the flush behind it outstanding). Returns the target, its
    buffer (zeros: nothing landed yet) and the name the target imported the
    writer under. ``lanes``: both agents' (the target's with express twins
    too); ``paired``: both imports (the writer's, and the target's that its
    fence closes); ``dials``: the target imports the writer this many
    times, fencing each import but the last, the writer it once (with the
    target's last ``ordinal`` when asked)."""
    target = make_agent("target", progress="poll", ucx_options=TCP, lanes=lanes, express=lanes > 1)
    writer = make_agent("writer", ucx_options=TCP, lanes=lanes, transfer_timeout_s=1.0)
    theirs, mine = np.zeros(NBYTES, dtype=np.uint8), np.full(NBYTES, FILL, dtype=np.uint8)
    target.register(theirs)
    writer.register(mine)
    link = ""
    for dial in range(1, dials + 1):
        if dial > 1:
            progress_for(target, 0.2)
            assert target.remove_peer(link, fence=True) is True
        link = target.add_peer(writer.metadata(), name=f"writer#{dial}" if dials > 1 else None, paired=paired)
    writer.add_peer(target.metadata(), paired=paired, ordinal=target.ordinal(link) if ordinal else None)
    loc, rem = DescList([mine.ctypes.data], NBYTES), DescList([theirs.ctypes.data], NBYTES)
    first = writer.write("target", loc, rem, timeout_s=60.0)  # both endpoints wired up (a loaded host: no 1 s)
    wait_until(first.done, 30.0, "a first write", drive=[target])
    theirs[:] = 0
    stuck = writer.write("target", loc, rem, notify=b"push-token")
    with pytest.raises(TransferError, match="deadline"):
        stuck.wait(30.0)
    assert stuck.abandoned, "the writer's transport says the write may still land"
    assert not theirs.any()
    return target, theirs, link


def fence(target, theirs, link, holds: bool, lands: int = NBYTES) -> None:
    """Fence ``link`` on ``target``. ``holds``: nothing of the abandoned write
    lands after the fence returned; else (the hazard) at least ``lands``
    bytes of it in all, after a fence that returned True all the same."""
    assert target.remove_peer(link, fence=True) is True
    at_fence = landed(theirs)
    assert at_fence < NBYTES // 2, "half of it landed before the fence: this run shows nothing"
    if holds:
        progress_for(target, 1.0)
        assert landed(theirs) == at_fence, (
            f"{landed(theirs) - at_fence} bytes of the writer's abandoned write landed after the fence returned")
    else:
        wait_until(lambda: landed(theirs) >= lands, 30.0, f"the write, after the fence (landed {landed(theirs)})",
                   drive=[target])


def landed(buf: np.ndarray) -> int:
    return int(np.count_nonzero(buf == FILL))


def progress_for(agent, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        agent.progress()
        time.sleep(0.001)


def test_a_fenced_writer_lands_nothing_after_the_fence(make_agent):
    target, theirs, link = abandoned_write(make_agent)
    target.progress()  # the target runs again: the writer's queued bytes begin to arrive
    assert target.remove_peer(link, fence=True) is True
    at_fence = landed(theirs)
    progress_for(target, 1.0)
    assert landed(theirs) == at_fence, (
        f"{landed(theirs) - at_fence} bytes of the writer's abandoned write landed after the fence returned")
    assert at_fence < NBYTES, "all of it landed before the fence: this run shows nothing"


def test_without_the_fence_the_abandoned_write_lands_after_the_writer_failed_it(make_agent):
    """The hazard the fence is for: the write the writer failed lands whole
    in the target's memory, its endpoint to the writer closed gracefully."""
    target, theirs, link = abandoned_write(make_agent)
    assert target.remove_peer(link) is True
    wait_until(lambda: landed(theirs) == NBYTES, 30.0, f"the rest of the write (landed {landed(theirs)})",
               drive=[target])


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "unpaired"])
def test_a_writer_with_lanes_is_fenced_only_through_paired_imports(make_agent, paired):
    """Two workers on each side (the default on two CPUs), the target's
    endpoints with express twins. ``paired`` (as push mode imports both
    ways): the writer's 32 MiB go on its own worker's one endpoint, which
    UCX pairs with the target's, and the fence stops them. Unpaired, the
    writer stripes the write over its lane too, whose endpoint pairs with
    none of the target's: the fence returns True and the lane's half (16
    MiB) lands after it, as it did in a decode's freed blocks (80 of 80,
    ``tests/faults/test_netns_late_bytes.py``'s push-striped, before the
    connector imported ``paired``)."""
    target, theirs, link = abandoned_write(make_agent, lanes=2, paired=paired)
    fence(target, theirs, link, holds=paired, lands=NBYTES // 2)


@pytest.mark.parametrize("ordinal", [True, False], ids=["ordinal", "no-ordinal"])
def test_a_link_the_writer_never_imported_is_made_up_by_the_ordinal(make_agent, ordinal):
    """The target dials the writer twice (``paired``), fencing the first
    link, but the writer imports it only once, for the second: an
    introduction whose answer was lost, not knowing whether it was
    imported. The writer's one endpoint is its first to the target, the
    target's current one its second. With the target's ``ordinal`` the
    writer makes and closes one endpoint first, and its import pairs with
    the target's second: the fence stops the abandoned write. Without it,
    the import pairs with the target's first (closed), and all 32 MiB land
    after a fence that returned True."""
    target, theirs, link = abandoned_write(make_agent, lanes=2, paired=True, dials=2, ordinal=ordinal)
    assert link == "writer#2" and target.ordinal(link) == 2
    fence(target, theirs, link, holds=ordinal)


def test_an_ordinal_the_worker_passed_already_imports_nothing(make_agent):
    """A stale introduction (its endpoint number below what this worker made
    already) is refused and replaces nothing; an ordinal needs ``paired``."""
    from rdma_kv.errors import ConfigError, PeerError

    a = make_agent("a", ucx_options=TCP, lanes=2)
    b = make_agent("b", ucx_options=TCP, lanes=2)
    assert a.add_peer(b.metadata(), paired=True, ordinal=3) == "b"
    assert a.ordinal("b") == 3  # two made up first
    with pytest.raises(PeerError, match="made 3 to it already"):
        a.add_peer(b.metadata(), paired=True, ordinal=3)
    assert a.peers == ("b",) and a.ordinal("b") == 3  # the import it has stays
    a.add_peer(b.metadata(), name="b2", paired=True)
    assert a.ordinal("b2") == 4
    with pytest.raises(ConfigError, match="paired=True"):
        a.add_peer(b.metadata(), name="b3", ordinal=5)
    a.add_peer(b.metadata(), name="b4")  # unpaired: its lane's endpoint is another worker's
    assert a.ordinal("b4") == 5


def test_a_paired_import_past_what_ucx_pairs_or_after_a_failed_create_is_refused(make_agent, monkeypatch):
    """UCX numbers a worker's endpoints to another in 16 bits and pairs none
    from 0xFFFF on; a failed ``ucp_ep_create`` may or may not have taken a
    number. Either way a ``paired`` import could pair with nothing the
    peer's fence closes: refused (an unpaired one is not)."""
    from rdma_kv.errors import PeerError
    from rdma_kv.transport import peers as peers_module
    from rdma_kv.transport import ucx

    a = make_agent("a", ucx_options=TCP, lanes=1)
    b = make_agent("b", ucx_options=TCP, lanes=1)
    monkeypatch.setattr(peers_module, "MAX_PAIRED_ENDPOINTS", 3)
    a.add_peer(b.metadata(), name="b1", paired=True, ordinal=3)
    with pytest.raises(PeerError, match="UCX pairs at most 3"):
        a.add_peer(b.metadata(), name="b2", paired=True)
    a.add_peer(b.metadata(), name="b3")  # unpaired: allowed
    worker = a._core.worker
    worker.lose_count(ucx_address(b))
    assert worker.endpoints_made(ucx_address(b)) == -1
    monkeypatch.setattr(peers_module, "MAX_PAIRED_ENDPOINTS", ucx.MAX_PAIRED_ENDPOINTS)
    with pytest.raises(PeerError, match="failed to be made"):
        a.add_peer(b.metadata(), name="b4", paired=True)
    assert set(a.peers) == {"b1", "b3"}


def test_a_count_is_kept_however_many_other_workers_were_counted_since(make_agent):
    """UCX keeps its number of endpoints to each remote worker for the
    worker's life; so does the count a ``paired`` import is numbered by. A
    bounded table (65,536, least recently counted forgotten) read a forgotten
    count as 0: the next import was padded from there and paired with none
    of the peer's endpoints (a review's reproduction with real UCX: all of an
    abandoned 32 MiB write landed after a fence that returned True)."""
    a = make_agent("a", ucx_options=TCP, lanes=1)
    b = make_agent("b", ucx_options=TCP, lanes=1)
    a.add_peer(b.metadata(), name="b1", paired=True, ordinal=2)
    worker = a._core.worker
    for i in range(70_000):  # other remote workers, each counted once (decodes woken and restarted, say)
        worker.count_endpoint(b"other worker %d" % i)
    assert worker.endpoints_made(ucx_address(b)) == 2
    a.add_peer(b.metadata(), name="b2", paired=True, ordinal=3)
    assert a.ordinal("b2") == 3 and a._core.worker.endpoints_made(ucx_address(b)) == 3


def ucx_address(agent) -> bytes:
    from rdma_kv.transport import metadata as wire

    return wire.decode(agent.metadata()).worker_address


def test_more_endpoints_missing_than_one_import_makes_up_are_made_up_over_several(make_agent, monkeypatch):
    from rdma_kv.errors import PeerError
    from rdma_kv.transport import peers as peers_module

    monkeypatch.setattr(peers_module, "MAX_PAD", 4)
    a = make_agent("a", ucx_options=TCP, lanes=1)
    b = make_agent("b", ucx_options=TCP, lanes=1)
    with pytest.raises(PeerError, match="4 made up now, 5 left: introduce again"):
        a.add_peer(b.metadata(), paired=True, ordinal=10)
    with pytest.raises(PeerError, match="4 made up now, 1 left"):
        a.add_peer(b.metadata(), paired=True, ordinal=10)
    assert a.add_peer(b.metadata(), paired=True, ordinal=10) == "b" and a.ordinal("b") == 10
