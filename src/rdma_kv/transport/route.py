"""Routes: the C record a request is posted on (``rk_route_t``, csrc/shim.h).

A route gathers once what every request to one peer needs, so that a
request is one C call (``rk_submit``, through the in-flight table): the
peer's endpoint, remote keys and endpoint state on every worker (the
agent's own, then each lane's: its ``Paths``, kept on the ``Peer``), the
agent's memory handles, the agent's policy (stripe parts of at least
``lane_min_bytes``; spread whole smaller requests over the workers) and
its two sides: two prepared lists addressed by index (prepared.py: one
route per pair of lists, kept on the remote list), or the two sides'
region tables that explicit descriptors are located in (posting.py: one
route per peer, kept on the peer).

A route is current while the agent's ``Epoch`` (a C counter) stays put:
the memory registry moves it when the agent's regions change, the peer
table and the lanes when an endpoint is added, replaced, failed or
removed, and the agent when it closes; ``rk_submit`` checks it first and
posts nothing on a stale route. So a route never outlives an endpoint,
remote key or memory handle it names.

May import: rdma_kv.transport._lib, .descriptors, .lanes, .memory, .peer,
.pump, .registry, .ucx.
"""

from __future__ import annotations

from typing import Any

from rdma_kv.transport._lib import load
from rdma_kv.transport.descriptors import PreparedList
from rdma_kv.transport.lanes import Lanes
from rdma_kv.transport.memory import RegionTable
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.pump import Pump
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.ucx import Worker


class Epoch:
    """The C counter routes are checked against (``rk_route_t.epoch``)."""

    def __init__(self) -> None:
        self.c: Any = load()[0].new("uint64_t *")

    def move(self) -> None:
        """Every route built so far is stale (peers, regions or the agent changed)."""
        self.c[0] += 1


class Route:
    """A ``rk_route_t`` and what keeps its arrays alive. ``builder`` made it
    (a route is one agent's); ``local`` is the local prepared list of a
    prepared route (None for explicit descriptors); ``peer`` its peer."""

    __slots__ = ("c", "builder", "local", "peer", "_keep")

    def __init__(self, c: Any, builder: RouteBuilder, local: PreparedList | None, peer: Peer,
                 keep: tuple[Any, ...]) -> None:
        self.c = c
        self.builder = builder
        self.local = local
        self.peer = peer
        self._keep = keep


class RouteBuilder:
    """Builds the routes of one agent: its context ``ctx``, ``epoch``,
    ``registry``, ``lanes``, own ``worker`` and its ``pump`` (None when
    polled), and the policy ``lane_min_bytes``, ``spread`` and ``spread_alone``."""

    def __init__(self, ctx: Any, epoch: Epoch, registry: MemoryRegistry, lanes: Lanes, worker: Worker,
                 pump: Pump | None, lane_min_bytes: int, spread: bool,
                 spread_alone: bool) -> None:
        self._ffi, lib = load()
        self._ctx = ctx
        self._epoch = epoch
        self._registry = registry
        self._lanes = lanes
        self._worker = worker
        self._pump = pump
        self._lane_min_bytes = lane_min_bytes
        # Polling (no own pump): by bytes queued, the caller's own worker copying
        # nothing while it posts; pumped: in turn, every worker draining alike
        # (docs/design.md, "Spreading", has both measured).
        self._spread = (lib.RK_SPREAD_OFF if not spread else lib.RK_SPREAD_ALWAYS if spread_alone
                        else lib.RK_SPREAD_LEAST if pump is None else lib.RK_SPREAD_BUSY)

    def prepared(self, local: PreparedList, remote: PreparedList, peer: Peer) -> Route:
        """The route of (``local``, ``remote``) to ``peer``, current as of now.
        The caller holds the lock and has checked both lists and the peer."""
        assert local.c_tables is not None and remote.c_tables is not None, "lists come from prep_local/prep_remote"
        uniform = local.uniform_length
        sides = {"local": self._list_side(local.c_tables), "remote": self._list_side(remote.c_tables),
                 "uniform": uniform if uniform is not None and uniform == remote.uniform_length else 0}
        return self._build(peer, local, sides, (local.c_tables, remote.c_tables))

    def explicit(self, peer: Peer) -> Route:
        """The route of explicit descriptors to ``peer``: both sides' regions.
        The caller holds the lock and has checked the peer."""
        lside, lkeep = self._region_side(self._registry.table)
        rside, rkeep = self._region_side(peer.table)
        return self._build(peer, None, {"local": lside, "remote": rside, "uniform": 0}, (lkeep, rkeep))

    def _build(self, peer: Peer, local: PreparedList | None, sides: dict[str, Any], keep: tuple[Any, ...]) -> Route:
        ffi = self._ffi
        paths = self._lanes.paths(peer, self._worker, self._pump)
        memhs = self._registry.memhs
        c = ffi.new("rk_route_t *", dict(
            sides, ctx=self._ctx, nworkers=paths.count, eps=paths.eps, rkeys=paths.rkeys, xeps=paths.xeps,
            xrkeys=paths.xrkeys, express_below=2 * self._lane_min_bytes, workers=paths.workers,
            pumps=paths.pumps, ep_states=paths.ep_states, memhs=self._registry.memhs_c, epoch=self._epoch.c,
            built_at=self._epoch.c[0], lane_min_bytes=self._lane_min_bytes,
            spread=self._spread))
        return Route(c, self, local, peer, (paths, memhs, self._epoch, keep))

    @staticmethod
    def _list_side(tables: tuple[Any, Any, Any, int]) -> dict[str, Any]:
        addr, lengths, regions, n = tables
        return {"addr": addr, "len": lengths, "reg": regions, "n": n}

    def _region_side(self, table: RegionTable) -> tuple[dict[str, Any], tuple[Any, ...]]:
        ffi = self._ffi
        if not len(table):  # nothing registered: every descriptor fails its check
            return {"nregions": 0}, ()
        arrays = (ffi.from_buffer("uint64_t[]", table.bases), ffi.from_buffer("uint64_t[]", table.ends),
                  ffi.from_buffer("uint32_t[]", table.order))
        side = {"base": arrays[0], "end": arrays[1], "order": arrays[2], "nregions": len(table)}
        return side, (table, *arrays)
