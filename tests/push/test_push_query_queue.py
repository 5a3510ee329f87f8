"""The decode's queries of its pushes must not queue its new PUSHes behind
them (``consumer/pushes.Pushes.poll``).

The RPC pool runs the calls to one producer rank one at a time, in order
(``consumer/clients``). A push whose notification is late (a loaded host),
or a registration WAITING for its prefill (concurrent dispatch), is asked
about (PUSH_QUERY) a second after its answer and every half second after.
With a query queued per push due, a new PUSH to that rank waited for one
round trip per push already waiting: on a loaded 2-core host, where a side
channel round trip takes up to seconds, the wait grew with the number of
pushes waiting, past the load's own bound (tests/vllm/test_vllm_push.py,
128 in flight). Now at most one plain query per rank is queued or in flight;
a PUSH sent again and an abort are not held back.

A pool that queues the calls per address as the real one does, run by the
test; scripted answers; a fake clock."""

from __future__ import annotations

import collections

from test_decode_pushes import Client, kinds, setup

from rdma_kv.connector.rdma import wire

S = wire.PushState


class QueuedPool:
    """Calls per address, in order, run when the test says (``run``)."""

    def __init__(self, client):
        self.client = client
        self.queue = collections.deque()

    def get(self, host, port):
        return self.client

    def submit(self, fn, handle, to=None):
        self.queue.append((fn, handle))
        return True

    def run(self, n=None):
        """Run ``n`` queued calls (all, and those they queue, when None)."""
        done = 0
        while self.queue and (n is None or done < n):
            fn, handle = self.queue.popleft()
            fn(handle)
            done += 1


class Answers(Client):
    """RUNNING to a PUSH, the state in ``states`` (by token) to a query."""

    def __init__(self):
        super().__init__()
        self.states = collections.defaultdict(lambda: S.RUNNING)

    def call(self, request, timeout_s=None):
        self.sent.append(request)
        if isinstance(request, wire.PushQuery):
            if request.abort:
                return wire.PushReply(S.ABORTED, "aborted")
            return wire.PushReply(self.states[request.token], "", 10.0)
        return wire.PushReply(S.RUNNING, "", 10.0)


def start(pushes, peer, request, token):
    return pushes._begin(peer, wire.Push(**{**{f: getattr(request, f) for f in request.__struct_fields__},
                                            "token": token}), [[40, 41]])


def test_a_new_push_waits_behind_at_most_one_query_of_the_pushes_already_waiting():
    client = Answers()
    pushes, clock, request, peer, failed = setup(client)
    pool = pushes._pool = QueuedPool(client)
    handles = [start(pushes, peer, request, bytes([i]) * 16) for i in range(50)]
    pool.run()  # every PUSH answered RUNNING; no notification comes (a loaded host)
    assert kinds(client) == ["Push"] * 50
    clock.t += 2.0  # every one of them is due for a query
    pushes.poll()
    new = start(pushes, peer, request, b"n" * 16)
    ahead = [fn.__name__ for fn, h in pool.queue].index("_send")
    assert ahead <= 1, f"the new PUSH is queued behind {ahead} queries of the pushes already waiting"
    pool.run()
    assert new.answered and not failed

    # Every waiting push is still asked about, each in turn (the one longest due first).
    asked = collections.Counter()
    for _ in range(200):
        clock.t += 0.1
        pushes.poll()
        pool.run()
    for r in client.sent:
        if isinstance(r, wire.PushQuery):
            asked[r.token] += 1
    assert all(asked[h.token] >= 2 for h in handles), sorted(asked.values())[:5]

    # An answer DONE resolves each; an abort is not held behind the rank's query.
    for h in handles[:-1]:
        client.states[h.token] = S.DONE
    pushes.abort(handles[-1])
    pushes.poll()
    assert [fn.__name__ for fn, h in pool.queue].count("_query") == 2  # the abort, and one plain query
    for _ in range(100):
        clock.t += 0.5
        pushes.poll()
        pool.run()
    assert all(h.done() for h in handles[:-1]) and all(h.error is None for h in handles[:-1])
    assert handles[-1].done() and "aborted" in str(handles[-1].error)
    assert pushes._probing == set()
