"""What a transfer that outlived its deadline was waiting for.

Read from the shim before the agent fails the peer (which cancels the
transfer's operations): how many of its operations UCX had not completed,
whether its notification had gone out, and for each worker it was posted
on, what that worker's pump was doing (held by a poster, in progress,
asleep on its worker's fd, dozing because the fd keeps waking it for
nothing, or spinning), how long ago it last progressed
the worker, and its thread as the kernel saw it (state, the CPUs it may
run on, CPU time, time spent runnable but waiting for a CPU). One line
for the operator's log: it tells a peer that stopped answering from a
worker nobody progressed and from a process that got no CPU.

May import: rdma_kv.transport._lib.
"""

from __future__ import annotations

from typing import Any

from rdma_kv.transport._lib import load


DOZING = ("dozing, its fd waking it with nothing to progress (over TCP: a peer that has not progressed "
          "its side of the connection since it was made: stopped, or given no CPU)")


def describe(batch: Any, pumps: Any, now_ns: int) -> str:
    """``batch`` is the transfer's ``rk_batch_t``, ``pumps`` the route's
    ``rk_pump_t *[]`` by worker (None or NULL entries: no pump)."""
    parts = [f"{int(batch.pending)} of {int(batch.posted)} operations outstanding"]
    if batch.has_notif:
        parts.append("notification sent" if batch.notif_sent else "notification not sent")
    for k in range(int(batch.nparts)):
        w = int(batch.top) - k
        parts.append(pump(worker_name(w), pumps[w] if pumps is not None else None, now_ns))
    return "; ".join(parts)


def worker_name(w: int) -> str:
    return "own worker" if w == 0 else f"lane {w}"


def pump(who: str, handle: Any, now_ns: int) -> str:
    """What the pump ``handle`` (``rk_pump_t *``; None or NULL: none) of
    the worker ``who`` is doing."""
    ffi, lib = load()
    if handle is None or handle == ffi.NULL:
        return f"{who}: no pump (progressed by its caller)"
    out = ffi.new("uint64_t[5]")
    lib.rk_pump_state(handle, out)
    hold, busy, asleep, ran, taken = (int(v) for v in out)
    doing = (f"napping, its worker taken by {taken} blocked caller(s)" if taken
             else f"held by {hold} poster(s)" if hold else "in progress" if busy
             else DOZING if asleep == 2 else "asleep on its fd" if asleep else "spinning")
    since = f"last progressed its worker {(now_ns - ran) / 1e9:.3f} s ago" if ran else "never progressed its worker"
    return f"{who}: pump {doing}, {since}, {thread(int(lib.rk_pump_tid(handle)))}"


def thread(tid: int) -> str:
    """The kernel's view of thread ``tid`` of this process (0: a pump whose
    thread has not entered its loop)."""
    if tid == 0:
        return "its thread not yet in its loop"
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run_ns, wait_ns, _ = (int(v) for v in f.read().split())
        with open(f"/proc/self/task/{tid}/status") as f:
            cpus = next((line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list:")), "?")
    except (OSError, ValueError):
        return f"thread {tid} not readable"
    state = stat[stat.rindex(")") + 2:].split()[0]
    return (f"thread {tid} state {state} on CPUs {cpus}, ran {run_ns / 1e9:.2f} s, "
            f"waited {wait_ns / 1e9:.2f} s for a CPU")
