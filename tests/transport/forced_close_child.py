"""Child of test_shim_lifetimes.py: three threads post notified writes and
reads over TCP with deadlines of a nanosecond to a microsecond, so that
the peer is failed (its endpoints force-closed) again and again while
operations and endpoint flushes are in flight, and re-import it each
time. Exit 0: every transfer settled, no thread hung; a crash is the
parent's to see (SIGSEGV: UCX resumed a flush of an endpoint closed under
it). argv: SEED MODE SECONDS."""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
import time

import numpy as np

from rdma_kv.errors import DescriptorError, PeerError, TransferError
from rdma_kv.transport import Agent, AgentConfig, DescList

TCP = {"TLS": "tcp", "NET_DEVICES": "lo"}
BLOCK, NBLOCKS = 4096, 256


def main() -> int:
    seed, mode, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    faulthandler.enable()
    target = Agent("target", AgentConfig(ucx_options=TCP, lanes=1))
    reader = Agent("reader", AgentConfig(ucx_options=TCP, lanes=3, progress=mode, lane_min_bytes=1 << 16,
                                         max_inflight=32))
    theirs = np.ones(NBLOCKS * BLOCK, dtype=np.uint8)
    mine = np.zeros(NBLOCKS * BLOCK, dtype=np.uint8)
    target.register(theirs)
    reader.register(mine)
    metadata = target.metadata()
    lock = threading.Lock()
    state = {"peer": reader.add_peer(metadata)}
    unexpected: list[str] = []
    end = time.monotonic() + seconds

    def lists():
        return (reader.prep_local(DescList(mine.ctypes.data + BLOCK * np.arange(NBLOCKS, dtype=np.uint64), BLOCK)),
                reader.prep_remote(state["peer"], DescList(theirs.ctypes.data
                                                          + BLOCK * np.arange(NBLOCKS, dtype=np.uint64), BLOCK)))

    def work(k: int) -> None:
        r = random.Random(seed * 10 + k)
        while time.monotonic() < end:
            try:
                with lock:
                    local, remote = lists()
                n = r.choice([1, 8, 64, NBLOCKS])
                post = reader.read_prepared if r.random() < 0.5 else reader.write_prepared
                xfers = [post(local, np.arange(n), remote, np.arange(n), timeout_s=r.choice([1e-9, 1e-6, 5.0]),
                              notify=b"x" if r.random() < 0.5 else None) for _ in range(r.randint(1, 4))]
                for x in xfers:
                    try:
                        x.wait(timeout_s=30)
                    except TransferError:
                        pass  # a deadline, or the peer failed by another's
            except (PeerError, DescriptorError, TransferError):
                with lock:  # failed, or lists of an earlier incarnation: import it again
                    try:
                        state["peer"] = reader.add_peer(metadata)
                    except Exception as exc:  # noqa: BLE001 -- reported
                        unexpected.append(f"add_peer: {exc!r}")
            except Exception as exc:  # noqa: BLE001 -- reported
                unexpected.append(repr(exc))
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
        if t.is_alive():
            unexpected.append("a thread hung")
    reader.close()
    target.close()
    print(unexpected[:3], flush=True)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
