"""Child of test_take_stress.py's overlap test, run with
csrc/progress_overlap.c preloaded: callers wait() on one striping pumped
agent from four threads (taking its own worker while its pump is kicked
awake by their posts), a fifth posts and waits on callbacks only; then
prints the probe's counts as JSON: overlaps (a pump and another thread
inside one worker's ucp_worker_progress at once), pump calls, other calls."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading

import numpy as np

from rdma_kv.transport import Agent, AgentConfig
from transport_helpers import TCP, link, prepare_slots

BLOCK = 4096
ROUNDS = 60
WAIT_S = 60.0


def main() -> None:
    probe = ctypes.CDLL(os.environ["LD_PRELOAD"])
    a = Agent("a", AgentConfig(ucx_options=dict(TCP), lanes=1))
    b = Agent("b", AgentConfig(ucx_options=dict(TCP), lanes=3, lane_min_bytes=2 * BLOCK, spin_s=0.002))
    pair = link(a, b)
    local, remote = prepare_slots(pair, BLOCK)
    failures: list[BaseException] = []

    def user(t: int) -> None:
        rng = np.random.default_rng(t)
        try:
            for _ in range(ROUNDS):
                idx = rng.permutation(32)[: int(rng.integers(1, 32))] + 32 * t
                xfer = b.read_prepared(local, idx, remote, idx, timeout_s=WAIT_S)
                if t < 4:
                    xfer.wait(WAIT_S)
                else:
                    done = threading.Event()
                    xfer.add_done_callback(lambda _: done.set())
                    assert done.wait(WAIT_S)
                assert np.array_equal(pair.buf_b[idx[0] * BLOCK:(idx[0] + 1) * BLOCK],
                                      pair.buf_a[idx[0] * BLOCK:(idx[0] + 1) * BLOCK])
        except BaseException as exc:  # noqa: BLE001 -- reported below
            failures.append(exc)

    threads = [threading.Thread(target=user, args=(t,)) for t in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    alive = any(thread.is_alive() for thread in threads)
    b.close()
    a.close()
    counts = (ctypes.c_uint64 * 3)()
    probe.progress_overlap_counts(counts)
    print(json.dumps({"overlaps": counts[0], "pump": counts[1], "other": counts[2], "hung": alive,
                      "failures": [repr(f) for f in failures]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
