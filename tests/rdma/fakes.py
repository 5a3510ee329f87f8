"""A fake transport for the RDMA connector's unit tests: agents in one
process that "read" with ``ctypes.memmove``. Implements
``rdma_kv.connector.rdma.transport_api.Transport`` structurally.

Scripting: ``FakeFabric.hold = True`` keeps transfers pending until
``release_all()``; ``kill(name)`` fails that agent's pending transfers and
makes later reads from it fail (a dead peer); ``fail_next`` fails the next
read, ``fail_chained`` the next chained read (its read landed), ``abandon_next``
the next read or write as abandoned (nothing landed; its data and chained read land
at ``land_late()``); ``abandon_pending()`` the held writes likewise; a target's
``remove_peer(..., fence=True)`` stops the writes crossing the link UCX
pairs with that endpoint, held or abandoned (``FakeFabric.fence``);
``on_prep(agent_name)``, when set, runs inside ``prep_local`` and
``prep_remote`` (where the real transport takes its own lock).
"""

from __future__ import annotations

import ctypes
import threading
import time

import msgspec
import numpy as np

from rdma_kv.errors import DescriptorError, PeerError, TransferError
from rdma_kv.transport.descriptors import DescList, coalesce


def _copy(ops):
    """What the fabric's reads and writes do: each (destination, source, length) copied."""
    laddr, raddr, lengths = ops
    for d, s, n in zip(laddr.tolist(), raddr.tolist(), lengths.tolist()):
        ctypes.memmove(d, s, n)


class FakeTransfer:
    def __init__(self, fabric, peer, laddr, raddr, lengths, ops):
        self._fabric = fabric
        self.peer = peer
        self._ops = (laddr, raddr, lengths)
        self.error = None
        self.ops_posted = ops
        self.num_descs = len(lengths)
        self.nbytes = int(lengths.sum())
        self.post_s = 0.0
        self._started = time.perf_counter()
        self._finished = None
        self._callbacks = []
        self._lock = threading.Lock()
        self._resolved = threading.Event()
        self.chained = None  # with a chained read: True once posted (the read landed), False if it was not
        self.abandoned = False  # failed before it completed (abandon_next): it may still land
        self.via = None  # the import (transport peer name) it was posted through, if prepared for one
        self.link = None  # a write's (poster's worker, its endpoint's number, target's worker, paired): FakeFabric.fence
        self._then = None  # the chained read's (laddr, raddr, lengths), until it is posted

    @property
    def started(self):
        return self._started

    @property
    def elapsed_s(self):
        return (self._finished or time.perf_counter()) - self._started

    def done(self):
        return self._finished is not None

    def wait(self, timeout_s=None):
        if not self._resolved.wait(timeout_s):
            raise TimeoutError(f"fake transfer not resolved after {timeout_s} s")
        if self.error is not None:
            raise self.error
        return self

    def add_done_callback(self, fn):
        with self._lock:
            if self._finished is None:
                self._callbacks.append(fn)
                return
        fn(self)

    def _abandon(self, error=None):
        """Fail it now, as the transport does at a deadline UCX did not
        cancel: nothing landed yet, its data and chained read stay on the
        fabric (``FakeFabric.land_late``)."""
        with self._lock:
            late, self._then = (self._ops, self._then, self), None  # (a failed resolve copies nothing)
            self.abandoned, self.chained = True, (False if late[1] is not None else None)
        with self._fabric.lock:
            self._fabric.late.append(late)
        self._resolve(error or TransferError("fake: abandoned at its deadline", status="UCS_ERR_TIMED_OUT"))

    def _resolve(self, error=None):
        with self._lock:
            if self._finished is not None:
                return
            if error is None:
                _copy(self._ops)
            if self._then is not None:  # the read landed: its chained read goes out (held too, if the fabric holds)
                self.chained = error is None
                if error is None:
                    self._ops, self._then = self._then, None
                    if self._fabric.fail_chained:
                        self._fabric.fail_chained -= 1
                        error = TransferError("fake: injected chained read failure", status="UCS_ERR_IO_ERROR")
                    elif self._fabric.hold:
                        with self._fabric.lock:
                            self._fabric.pending.append(self)
                        return
                    else:
                        _copy(self._ops)
            self.error = error
            self._finished = time.perf_counter()
            callbacks, self._callbacks = self._callbacks, []
            self._resolved.set()
        if error is None and getattr(self, "notify", None) is not None:
            self.notify()  # a write's notification: after its data landed, as UCX's flush then send
        for fn in callbacks:
            fn(self)


class FakeFabric:
    def __init__(self):
        self.agents = {}
        self.dead = set()
        self.hold = False
        self.pending = []
        self.fail_next = 0
        self.fail_chained = 0
        self.abandon_next = 0
        self.late = []  # abandoned transfers' (data, chained read, transfer), landing only at land_late()
        self.on_prep = None
        self.reads = 0
        self.chained = 0  # reads posted with a chained read (the held words')
        self.writes = 0
        self.fenced_writes = 0  # held or abandoned writes a target's fence stopped
        self.lock = threading.Lock()

    def factory(self, name, settings=None):
        agent = FakeTransport(name, self)
        self.agents[name] = agent
        return agent

    def land_late(self):
        """What abandoned reads still had on the wire lands now: their data,
        then their chained reads (as UCX may complete a zombie's)."""
        with self.lock:
            late, self.late = self.late, []
        for data, then, _ in late:
            _copy(data)
            if then is not None:
                _copy(then)

    def abandon_pending(self, reader=None):
        """The held writes (of agent ``reader``, if given) fail at their
        deadline, abandoned: their bytes stay on the wire (``land_late``)
        unless the target fences the link they cross (``fence``)."""
        with self.lock:
            mine = [x for x in self.pending if x.link is not None and (reader is None or x.reader == reader)]
            self.pending = [x for x in self.pending if x not in mine]
        for xfer in mine:
            xfer._abandon()

    def fence(self, target, worker, ordinal):
        """Transport ``target`` force-closed its endpoint number ``ordinal``
        to ``worker``: as UCX, that closes the one connection it shares with
        the endpoint ``worker`` made to ``target`` with the same number, if
        that one is ``paired`` (on the worker's own UCX worker, no lane's:
        a lane's endpoint pairs with none of the target's). Writes crossing
        it, held or abandoned, never land; others still do (a review found
        the fake landed every abandoned write, fenced or not, so no test
        could tell a fence that reaches the writes from one that misses)."""
        link = (worker, ordinal, id(target), True)
        with self.lock:
            cut = [x for x in self.pending if x.link == link]
            self.pending = [x for x in self.pending if x.link != link]
            late = [entry for entry in self.late if entry[2].link != link]
            self.fenced_writes += len(cut) + len(self.late) - len(late)
            self.late = late
        for xfer in cut:
            xfer._resolve(TransferError("fake: connection reset by the target's fence",
                                        status="UCS_ERR_CONNECTION_RESET"))

    def release_all(self, error=None, reader=None):
        """Resolve the held transfers (only those posted by agent ``reader``, if given)."""
        with self.lock:
            pending = [x for x in self.pending if reader is None or x.reader == reader]
            self.pending = [x for x in self.pending if x not in pending]
        for xfer in pending:
            xfer._resolve(error)

    def kill(self, name):
        self.dead.add(name)
        with self.lock:
            mine = [x for x in self.pending if x.peer == name]
            self.pending = [x for x in self.pending if x.peer != name]
        for xfer in mine:
            xfer._resolve(TransferError(f"fake: peer {name!r} died", status="UCS_ERR_CONNECTION_RESET"))


class FakeNotification:
    def __init__(self, peer, payload):
        self.peer, self.payload = peer, payload


class FakePrep:
    def __init__(self, descs, peer, via=None, generation=0):
        self.descs, self.peer = descs, peer
        self.via, self.generation = via, generation  # a remote list's: the import it was prepared for

    def __len__(self):
        return len(self.descs)


class FakeTransport:
    def __init__(self, name, fabric):
        self.name, self.fabric = name, fabric
        self.regions = []
        self.memory_types = []  # register()'s memory_type, per region
        self.peers = {}
        self.aliases = {}
        self.paired = {}  # name -> imported ``paired`` (one endpoint, no lanes: what a fence needs)
        self.generations = {}  # name -> how many times it was imported (a remote list is of one of them)
        self.made = {}  # worker -> endpoints made to it (Agent.ordinal's count), by the peer transport's id
        self.ordinals = {}  # name -> its endpoint's number
        self.workers = {}  # name -> the worker it is an endpoint to
        self.padded = 0  # endpoints made up by ``ordinal``
        self.fenced = []  # remove_peer(name, fence=True) calls, by name
        self.closed = False
        self.wedge = False  # a test sets it to stand for a close that left the memory registered
        self.inbox = []  # notifications received (push mode)
        self.settles = 0  # settle() calls

    def register(self, obj, *, memory_type=None):
        base, nbytes = obj
        self.regions.append((base, nbytes))
        self.memory_types.append(memory_type)
        return (base, nbytes)

    def metadata(self):
        # ``worker``: this transport's identity, as a UCX worker's address (a new one per transport)
        return msgspec.msgpack.encode({"name": self.name, "regions": self.regions, "worker": id(self)})

    def add_peer(self, blob, *, name=None, paired=False, ordinal=None):
        md = msgspec.msgpack.decode(blob)
        if md["name"] not in self.fabric.agents:
            raise PeerError(f"fake: unknown agent {md['name']!r}")
        name = md["name"] if name is None else name
        made = self.made.get(md["worker"], 0)  # endpoints "made" to that worker, as a UCX worker counts them
        if ordinal is not None:
            if ordinal <= made:
                raise PeerError(f"fake: endpoint {ordinal} asked for, made {made} to it already")
            self.padded += ordinal - 1 - made
            made = ordinal - 1
        self.made[md["worker"]] = made + 1
        self.ordinals[name] = made + 1
        self.workers[name] = md["worker"]
        if name in self.peers:  # replaced: as the agent, its transfers in flight fail
            self._fail_via(name, "replaced by newly imported metadata")
        self.generations[name] = self.generations.get(name, 0) + 1
        self.peers[name] = [tuple(r) for r in md["regions"]]
        self.aliases[name] = md["name"]  # the agent behind the name it was imported under
        self.paired[name] = paired
        return name

    def ordinal(self, name):
        return self.ordinals[name]

    def remove_peer(self, name, *, fence=False):
        known = self.peers.pop(name, None) is not None
        self._fail_via(name, "fenced by remove_peer()" if fence else "removed by remove_peer()")
        if fence:
            self.fenced.append(name)
            if known:  # (its writes to this transport over the link paired with this endpoint)
                self.fabric.fence(self, self.workers[name], self.ordinals[name])
        return True

    def _fail_via(self, name, why):
        """As the agent's close of the import ``name`` with transfers in
        flight: they fail (canceled) and notify no one, but their bytes may
        still land (over TCP the target still takes what was queued: all 32
        MiB of a canceled write landed once the target progressed, a
        review's reproduction with real UCX). They go on the fabric's late
        list, as an abandoned transfer's (``FakeFabric.land_late``): only
        the *target's* fence stops them."""
        fabric = self.fabric
        with fabric.lock:
            mine = [x for x in fabric.pending if x.reader == self.name and x.via == name]
            fabric.pending = [x for x in fabric.pending if x not in mine]
        for xfer in mine:
            xfer._abandon(TransferError(f"fake: request canceled: peer {name!r} {why}", status="UCS_ERR_CANCELED"))

    @staticmethod
    def _check(descs, regions, what):
        for a, n in zip(descs.addrs.tolist(), descs.lengths.tolist()):
            if not any(b <= a and a + n <= b + size for b, size in regions):
                raise DescriptorError(f"fake: {what} descriptor {a:#x}+{n} outside registered memory")

    def prep_local(self, descs):
        assert isinstance(descs, DescList)
        if self.fabric.on_prep is not None:
            self.fabric.on_prep(self.name)
        return FakePrep(descs, None)

    def prep_remote(self, peer, descs):
        if self.fabric.on_prep is not None:
            self.fabric.on_prep(self.name)
        if peer not in self.peers:
            raise PeerError(f"fake: unknown peer {peer!r}")
        return FakePrep(descs, self.aliases[peer], via=peer, generation=self.generations.get(peer, 0))

    def read_prepared(self, local, local_index, remote, remote_index, *, notify=None, timeout_s=None, then=None):
        """A read; with ``then`` (a ``ChainedRead`` of the same peer), its
        chained read, copied once the read landed (held again while the
        fabric holds: a test decides when each lands)."""
        self.fabric.reads += 1
        chained = None
        if then is not None:
            self.fabric.chained += 1
            if then.remote.peer != remote.peer:
                raise DescriptorError("fake: a chained read reads from the same peer")
            chained = self._ops(then.local, then.local_index, then.remote, then.remote_index, write=False)
        return self._post(local, local_index, remote, remote_index, write=False, then=chained)

    @staticmethod
    def _ops(local, local_index, remote, remote_index, write):
        """(destinations, sources, lengths), merged."""
        li, ri = np.asarray(local_index, dtype=np.int64), np.asarray(remote_index, dtype=np.int64)
        laddr, lens = local.descs.addrs[li], local.descs.lengths[li]
        raddr = remote.descs.addrs[ri]
        if not np.array_equal(lens, remote.descs.lengths[ri]):
            raise DescriptorError("fake: lengths differ")
        zeros = np.zeros(len(li), dtype=np.uint32)
        dst, src = (raddr, laddr) if write else (laddr, raddr)
        return coalesce(dst, src, lens, zeros, zeros)

    def _post(self, local, local_index, remote, remote_index, write, notify=None, then=None):
        """A read copies remote -> local; a write local -> remote, then notifies the peer."""
        fabric = self.fabric
        if self.closed:
            raise PeerError("fake: closed")
        if remote.peer in fabric.dead:
            raise PeerError(f"fake: peer {remote.peer!r} failed")
        if remote.via is not None:  # (as the agent: a list of an import removed or replaced since is refused)
            if remote.via not in self.peers:
                raise PeerError(f"fake: unknown peer {remote.via!r}")
            if self.generations.get(remote.via) != remote.generation:
                raise DescriptorError(f"fake: a list for an earlier import of {remote.via!r}; prepare it again")
        merged = self._ops(local, local_index, remote, remote_index, write)
        xfer = FakeTransfer(fabric, remote.peer, merged[0], merged[1], merged[2], len(merged[0]))
        xfer.reader, xfer.via = self.name, remote.via
        if write and remote.via is not None:
            xfer.link = (id(self), self.ordinals[remote.via], self.workers[remote.via], self.paired[remote.via])
        if then is not None:
            xfer._then = then[:3]
        if notify is not None:
            target = fabric.agents[remote.peer]
            xfer.notify = lambda: target.inbox.append(FakeNotification(self.name, bytes(notify)))
        if fabric.fail_next:
            fabric.fail_next -= 1
            xfer._resolve(TransferError(f"fake: injected {'write' if write else 'read'} failure",
                                        status="UCS_ERR_IO_ERROR"))
        elif fabric.abandon_next:
            fabric.abandon_next -= 1
            xfer._abandon()
        elif fabric.hold:
            with fabric.lock:
                fabric.pending.append(xfer)
        else:
            xfer._resolve()
        return xfer

    def write_prepared(self, local, local_index, remote, remote_index, *, notify=None, timeout_s=None):
        """Push mode: write ``local[local_index]`` into the peer's
        ``remote[remote_index]``; the notification reaches the peer's
        ``get_notifications`` once the data was copied."""
        self.fabric.writes += 1
        return self._post(local, local_index, remote, remote_index, write=True, notify=notify)

    def flush(self, peer, *, notify=None, timeout_s=None):
        """Completes at once (the fake's writes copy when they resolve); with
        ``notify``, after the writes this agent posted through that import resolved."""
        fabric = self.fabric
        if peer not in self.peers:  # (as the agent: a name not imported, or removed since)
            raise PeerError(f"fake: unknown peer {peer!r}")
        via, peer = peer, self.aliases.get(peer, peer)
        xfer = FakeTransfer(fabric, peer, np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64), 0)
        xfer.reader, xfer.via = self.name, via
        if peer in fabric.dead or self.closed:
            xfer._resolve(PeerError(f"fake: peer {peer!r} failed"))
            return xfer
        if notify is not None:
            target = fabric.agents[peer]
            xfer.notify = lambda: target.inbox.append(FakeNotification(self.name, bytes(notify)))
        with fabric.lock:
            # (a flush is of one endpoint: of the operations posted through this import)
            earlier = [x for x in fabric.pending if x.reader == self.name and x.via == via]
            if earlier:  # a flush completes after every earlier operation to the peer
                fabric.pending.append(xfer)
                return xfer
        xfer._resolve()
        return xfer

    def get_notifications(self):
        out, self.inbox[:] = list(self.inbox), []
        return out

    def settle(self):
        """Transfers resolve on the fabric's own schedule: only counted here."""
        self.settles += 1

    def progress_report(self):
        return "fake transport: no progress threads"

    def wedged(self):
        return self.wedge

    def close(self):
        self.closed = True
