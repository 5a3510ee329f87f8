"""A caller's arrays changing while the call reads them (another thread
writes them: the call runs without the interpreter lock). The shim used to
read every pair twice, checking it the first time only; a pair changed in
between was posted unchecked, and a local descriptor of 64 KiB against a
remote one of 8 bytes at the end of the peer's region wrote 64 KiB past
it. Every pair is now checked as it is posted: such a transfer fails, with
an error that says why, and nothing lands outside the registered regions.
No test can force the race; each case below hit it within a few calls
on the old shim (each run fails there), and holds for every call now."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rdma_kv.errors import DescriptorError, TransferError
from rdma_kv.transport import DescList

M = 50_000  # pairs of 8 bytes: the call reads for a while, the writer thread gets its turns
CALLS = 100
CANARY = 0xAA


def _flipping(array: np.ndarray, index: int, values: tuple[int, int]) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            for v in values:
                array[index] = v

    thread = threading.Thread(target=flip, daemon=True)
    thread.start()
    return thread, stop


@pytest.mark.parametrize("form", ["prepared", "explicit"])
def test_a_pair_changed_during_the_call_is_never_posted_unchecked(make_agent, form):
    target, initiator = make_agent("target"), make_agent("initiator")
    region = 8 * M
    theirs = np.zeros(region + (1 << 20), dtype=np.uint8)
    theirs[region:] = CANARY  # only [0, region) is registered: the rest is the target's other memory
    target.register((theirs.ctypes.data, region))
    mine = np.full(region + (1 << 20), 0x55, dtype=np.uint8)
    initiator.register(mine)
    peer = initiator.add_peer(target.metadata())
    if form == "prepared":
        # Local descriptor M is 64 KiB, M - 1 matches remote M - 1 (8 bytes, the region's last).
        laddr = np.append(mine.ctypes.data + 8 * np.arange(M, dtype=np.uint64), np.uint64(mine.ctypes.data + region))
        llen = np.append(np.full(M, 8, dtype=np.uint64), np.uint64(65536))
        local = initiator.prep_local(DescList(laddr, llen))
        raddr = np.append(theirs.ctypes.data + 8 * np.arange(M, dtype=np.uint64), np.uint64(theirs.ctypes.data))
        remote = initiator.prep_remote(peer, DescList(raddr, np.append(np.full(M, 8, dtype=np.uint64),
                                                                     np.uint64(16))))
        li, ri = np.arange(M, dtype=np.int64), np.arange(M, dtype=np.int64)
        thread, stop = _flipping(li, M - 1, (M, M - 1))

        def call():
            return initiator.write_prepared(local, li, remote, ri, timeout_s=30)
    else:
        # Every other 8 bytes (no two pairs merge); the last pair's local length flips to 64 KiB.
        idx = np.arange(0, M, 2, dtype=np.uint64)
        lengths = np.full(len(idx), 8, dtype=np.uint64)
        local_list = DescList(mine.ctypes.data + 8 * idx, lengths)
        remote_list = DescList(theirs.ctypes.data + 8 * (idx + 1), np.full(len(idx), 8, dtype=np.uint64))
        thread, stop = _flipping(lengths, len(idx) - 1, (65536, 8))

        def call():
            return initiator.write(peer, local_list, remote_list, timeout_s=30)
    try:
        for i in range(CALLS):
            try:
                call().wait(timeout_s=30)
            except DescriptorError:  # the change was there before the call's check: refused, nothing posted
                pass
            except TransferError as exc:
                assert "changed while the call read it" in str(exc), exc
            overrun = int((theirs[region:] != CANARY).sum())
            assert overrun == 0, f"call {i}: {overrun} bytes written past the target's registered region"
    finally:
        stop.set()
        thread.join(timeout=10)
    # The agent is still usable: the same call with the arrays left alone.
    call().wait(timeout_s=30)
