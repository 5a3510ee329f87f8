"""A reference for the heterogeneous-TP and hybrid byte mapping.

Both engines' KV caches are built in numpy, every rank of each, in the
layouts engines use (vLLM's CPU ``[blocks, heads, block_size, 2 * head]``,
KV-first ``[2, blocks, block_size, heads, head]`` with NHD or HND strides,
FlashInfer's ``[blocks, 2, block_size, heads, head]`` likewise, MLA's
``[blocks, block_size, latent]``), with one or two KV-cache groups (full
attention and a sliding window, each layer's own tensor or one tensor per
pair of layers as vLLM's hybrid allocator shares them). The producer's
bytes are a function of (layer, model-wide KV head, block, token, K/V,
element). The product then does what a decode rank does: the rank plan
(``PeerDirectory.plan``), the handshake's checks (compatibility record,
rank share), the slot tables (``PeerDirectory.tables``, from the geometry
the producer announces on the wire), the blocks a load reads per group
(``intake.blocks_to_read`` of what the producer offers,
``scheduler.request_finished``'s rule) and their slot indices
(``BlockPairs.slots``); the test copies each pair of descriptors and then
compares every byte of every consumer rank's cache with a per-head
reference copy. A pair the product refuses must be refused at one of those
checks (never a wrong byte), and a pair it is documented to take must be
taken.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma.compat import compat_info, group_heads, rank_info
from rdma_kv.connector.rdma.consumer.peers import Connection, LocalKV, PeerDirectory
from rdma_kv.connector.rdma.intake import blocks_to_read
from rdma_kv.connector.rdma.meta import PeerAddress
from rdma_kv.connector.rdma.slots import BlockPairs, SlotTable
from rdma_kv.connector.rdma.topology import heads_of
from rdma_kv.connector.rdma.wiregeom import GeometryWire
from rdma_kv.connector.specs import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                     MLAAttentionSpec, SlidingWindowSpec)
from rdma_kv.connector.types import EngineId
from rdma_kv.errors import ConfigError, DescriptorError

LAYOUTS = ("cpu", "lbnhc", "blhnc", "nhd", "hnd", "fi_nhd", "fi_hnd")
"""``cpu``: vLLM 0.32's ``[B, H, N, C]`` view (C: K and V packed per token) in
its LBHNC order (CPU, FlashInfer); ``lbnhc``: the same view in NHD order
(physical ``[B, N, H, C]``); ``blhnc``: LBHNC with the layers interleaved per
block (physical ``[B, L, H, N, C]``, one allocation for every layer); the
others: KV-first ``[2, B, N, H, D]`` and FlashInfer's ``[B, 2, N, H, D]`` of
earlier vLLMs and other engines, with NHD or HND strides."""
SLICEABLE = ("cpu", "blhnc", "hnd", "fi_hnd")
SENTINEL = 0xA5


@dataclasses.dataclass(frozen=True)
class Group:
    heads: int  # the model's KV heads in this group's layers (1: MLA)
    window: int | None  # a sliding window (tokens), or full attention


@dataclasses.dataclass(frozen=True)
class Case:
    total_kv_heads: int  # what the engine adapter passes (vLLM: model_config.get_total_num_kv_heads())
    groups: tuple[Group, ...]
    layers_per_group: int
    p_tp: int
    d_tp: int
    layout: str  # "mla" for an MLA cache
    dtype: str
    head_size: int
    block_size: int
    shared: bool  # vLLM's hybrid allocator: layer i of every group views one tensor
    num_tokens: int
    num_blocks: int = 24


def rank_heads(case: Case, group: Group, tp: int) -> int:
    return 1 if case.layout == "mla" else max(1, group.heads // tp)


def _raw(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A sentinel-filled allocation of ``shape`` elements of ``dtype``."""
    dt = np.dtype(dtype)
    return np.full(shape[:-1] + (shape[-1] * dt.itemsize,), SENTINEL, dtype=np.uint8).view(dt)


def _alloc(case: Case, heads: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(the layer's tensor as the engine registers it, its logical view
    ``[blocks, heads, block_size, 2, head]`` (MLA: ``[blocks, 1, block_size, 1, latent]``))."""
    B, bs, hd = num_blocks, case.block_size, case.head_size
    if case.layout == "mla":
        t = _raw((B, bs, hd), case.dtype)
    elif case.layout == "cpu":
        t = _raw((B, heads, bs, 2 * hd), case.dtype)
    elif case.layout == "lbnhc":
        t = _raw((B, bs, heads, 2 * hd), case.dtype).transpose(0, 2, 1, 3)
    elif case.layout == "blhnc":  # without a common page: a layer-compact allocation per layer
        t = _raw((B, heads, bs, 2 * hd), case.dtype)
    elif case.layout == "nhd":
        t = _raw((2, B, bs, heads, hd), case.dtype)
    elif case.layout == "hnd":
        t = _raw((2, B, heads, bs, hd), case.dtype).transpose(0, 1, 3, 2, 4)
    elif case.layout == "fi_nhd":
        t = _raw((B, 2, bs, heads, hd), case.dtype)
    else:
        t = _raw((B, 2, heads, bs, hd), case.dtype).transpose(0, 1, 3, 2, 4)
    return t, _view_of(case, t, heads)


def _spec(case: Case, group: Group, tp: int):
    common = dict(block_size=case.block_size, num_kv_heads=rank_heads(case, group, tp),
                  head_size=case.head_size, dtype=case.dtype)
    if case.layout == "mla":
        return MLAAttentionSpec(**common)
    if group.window is not None:
        return SlidingWindowSpec(**common, sliding_window=group.window)
    return FullAttentionSpec(**common)


def values(case: Case, layer: int, heads: range, blocks: np.ndarray, itemsize: int) -> np.ndarray:
    """The producer's bytes as integers of ``itemsize``: shape ``[len(blocks),
    len(heads), block_size, 2, head]`` (MLA: one head, one part)."""
    parts = 1 if case.layout == "mla" else 2
    h = np.asarray(list(heads), dtype=np.uint64).reshape(1, -1, 1, 1, 1)
    b = blocks.astype(np.uint64).reshape(-1, 1, 1, 1, 1)
    t = np.arange(case.block_size, dtype=np.uint64).reshape(1, 1, -1, 1, 1)
    k = np.arange(parts, dtype=np.uint64).reshape(1, 1, 1, -1, 1)
    e = np.arange(case.head_size, dtype=np.uint64).reshape(1, 1, 1, 1, -1)
    with np.errstate(over="ignore"):  # a hash: arithmetic modulo 2**64
        x = (np.uint64(layer + 1) * np.uint64(0x9E3779B97F4A7C15) + h * np.uint64(0xBF58476D1CE4E5B9)
             + b * np.uint64(0x94D049BB133111EB) + t * np.uint64(0x2545F4914F6CDD1D)
             + k * np.uint64(0x5851F42D4C957F2D) + e * np.uint64(0x14057B7EF767814F))
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    out = (x & np.uint64((1 << (8 * itemsize)) - 1)).astype(f"u{itemsize}")
    return np.where(out == np.array(int.from_bytes(bytes([SENTINEL]) * itemsize, "little"), dtype=out.dtype),
                    out ^ 1, out)


@dataclasses.dataclass
class Rank:
    rank: int
    config: KVCacheConfig
    caches: dict[str, np.ndarray]
    logical: dict[str, np.ndarray]
    heads: dict[str, range]  # per layer, the model-wide heads this rank holds
    geometry: object = None
    compat: object = None
    info: object = None


def build(case: Case, tp: int, rank: int) -> Rank:
    names, groups, tensors = [], [], []
    caches, logical, heads = {}, {}, {}
    per_group = [[f"g{g}.l{i}" for i in range(case.layers_per_group)] for g in range(len(case.groups))]
    specs = [_spec(case, g, tp) for g in case.groups]
    for g, (group, layer_names) in enumerate(zip(case.groups, per_group)):
        groups.append(KVCacheGroupSpec(tuple(layer_names), specs[g]))
    pages = {s.page_size_bytes for s in specs}
    shared = case.shared and len(pages) == 1 and len(case.groups) > 1
    if case.layout == "blhnc" and len(pages) == 1 and len({rank_heads(case, g, tp) for g in case.groups}) == 1:
        # One allocation, the layers interleaved per block: [B, L, H, N, C].
        h = rank_heads(case, case.groups[0], tp)
        L = case.layers_per_group * len(case.groups)
        raw = _raw((case.num_blocks, L, h, case.block_size, 2 * case.head_size), case.dtype)
        order = [per_group[g][i] for i in range(case.layers_per_group) for g in range(len(case.groups))]
        for li, name in enumerate(order):
            g = int(name[1:name.index(".")])
            caches[name] = raw[:, li]
            logical[name] = _view_of(case, raw[:, li], h)
            heads[name] = heads_of(rank, tp, case.groups[g].heads)
        tensors.append(KVCacheTensor(specs[0].page_size_bytes * case.num_blocks * L, tuple(order)))
        return Rank(rank, KVCacheConfig(case.num_blocks, tuple(tensors), tuple(groups)), caches, logical, heads)
    for i in range(case.layers_per_group):
        base = None
        for g, group in enumerate(case.groups):
            name = per_group[g][i]
            h = rank_heads(case, group, tp)
            if base is None or not shared:
                t, view = _alloc(case, h, case.num_blocks)
                base = t
                tensors.append(KVCacheTensor(specs[g].page_size_bytes * case.num_blocks, (name,)))
            else:  # one allocation, another view of it (vLLM's hybrid allocator)
                t, view = base, _view_of(case, base, h)
                last = tensors[-1]
                tensors[-1] = KVCacheTensor(last.size, last.shared_by + (name,))
            caches[name], logical[name] = t, view
            heads[name] = range(0, 1) if case.layout == "mla" else heads_of(rank, tp, group.heads)
            names.append(name)
    config = KVCacheConfig(case.num_blocks, tuple(tensors), tuple(groups))
    return Rank(rank, config, caches, logical, heads)


def _view_of(case: Case, t: np.ndarray, heads: int) -> np.ndarray:
    """Another logical view of tensor ``t`` (a layer sharing its allocation)."""
    B, bs, hd = case.num_blocks, case.block_size, case.head_size
    if case.layout == "mla":
        return t.reshape(B, 1, bs, 1, hd)
    if case.layout in ("cpu", "lbnhc", "blhnc"):
        return t.reshape(B, heads, bs, 2, hd) if t.flags.c_contiguous else \
            np.lib.stride_tricks.as_strided(t, (B, heads, bs, 2, hd),
                                            t.strides[:3] + (hd * t.itemsize, t.itemsize))
    if case.layout in ("nhd", "hnd"):
        return t.transpose(1, 3, 2, 0, 4)
    return t.transpose(0, 3, 2, 1, 4)


def fill_producer(case: Case, r: Rank, blocks: list[np.ndarray]) -> None:
    """Each layer's blocks of the request (its group's ``blocks``); layers
    sharing an allocation own disjoint blocks of it, as in vLLM."""
    for li, (name, view) in enumerate(r.logical.items()):
        ids = blocks[r.config.group_index(name)]
        v = values(case, li, r.heads[name], ids, view.itemsize)
        view.view(v.dtype)[ids] = v


class _Transport:
    """What the peer directory's tables call: prepared lists are the descriptors."""

    def prep_local(self, descs):
        return descs

    def prep_remote(self, peer, descs):
        return descs


def _finish(case: Case, r: Rank, tp: int) -> None:
    r.geometry = derive_geometry(r.caches, r.config)
    r.compat = compat_info(r.config, r.geometry, case.total_kv_heads)
    r.info = rank_info(r.config, r.rank, tp)


def _copy(local: SlotTable, remote: SlotTable, lslots: np.ndarray, rslots: np.ndarray) -> None:
    la, ll = local.descs.addrs[lslots], local.descs.lengths[lslots]
    ra, rl = remote.descs.addrs[rslots], remote.descs.lengths[rslots]
    assert np.array_equal(ll, rl), "a read pairs descriptors of different lengths"
    for a, b, n in zip(la.tolist(), ra.tolist(), ll.tolist()):
        ctypes.memmove(a, b, n)


class Refused(Exception):
    pass


def load(case: Case, seed: int) -> tuple[list[Rank], list[Rank], list[dict[str, dict[int, int]]]]:
    """Run every decode rank's load. Returns (producer ranks, decode ranks,
    per decode rank and layer, local block -> producer block read into it);
    raises Refused with the product's reason where it refused."""
    rng = np.random.default_rng(seed)
    P = [build(case, case.p_tp, p) for p in range(case.p_tp)]
    D = [build(case, case.d_tp, d) for d in range(case.d_tp)]
    for r in P:
        _finish(case, r, case.p_tp)
    for r in D:
        _finish(case, r, case.d_tp)
    # The request's blocks, per group, on each side (block ids shared by every rank of an engine).
    specs = [g.kv_cache_spec for g in D[0].config.kv_cache_groups]
    n = -(-case.num_tokens // case.block_size)
    # Block ids are unique across groups (one block pool per engine).
    pperm, dperm = rng.permutation(case.num_blocks), rng.permutation(case.num_blocks)
    pids = [pperm[g * n:(g + 1) * n] for g in range(len(specs))]
    dids = [dperm[g * n:(g + 1) * n] for g in range(len(specs))]
    for r in P:
        fill_producer(case, r, pids)
    local, remote = [], []
    for g, spec in enumerate(specs):
        first = spec.num_skipped_blocks(case.num_tokens)  # what the producer offers (request_finished)
        got = blocks_to_read(spec, case.num_tokens, 0, dids[g].tolist(), pids[g][first:n].tolist())
        assert not isinstance(got, str), got
        local.append(np.asarray(got[0], dtype=np.int64))
        remote.append(np.asarray(got[1], dtype=np.int64))
    pairs = BlockPairs.of(tuple(local), tuple(remote))
    address = PeerAddress(EngineId("P"), "127.0.0.1", 1, case.p_tp)
    wrote: list[dict[str, dict[int, int]]] = []
    for d in D:
        slots = SlotTable(d.geometry)
        kv = LocalKV(_Transport(), d.geometry, slots, slots.descs, d.compat, d.info, group_heads(d.config))
        directory = PeerDirectory(kv, EngineId("D"), d.rank, threading.RLock(), None, None, time.monotonic,
                                  lambda *a: None)
        try:
            plan = directory.plan(address)
        except ConfigError as exc:
            raise Refused(f"plan: {exc}") from exc
        for read in plan.reads:
            p = P[read.rank]
            # The handshake's checks (PeerDirectory._ask).
            mismatches = d.compat.mismatches(p.compat)
            if mismatches:
                raise Refused(f"compat: {mismatches}")
            if p.info != type(p.info)(read.rank, case.p_tp, plan.remote_heads):
                raise Refused(f"rank: {p.info}")
            wire_geometry = msgspec.msgpack.decode(msgspec.msgpack.encode(GeometryWire.from_geometry(p.geometry)),
                                                   type=GeometryWire).to_geometry()
            conn = Connection("P", wire_geometry, 1, 0.0)
            try:
                (ltab, _), (rtab, _) = directory.tables(plan, read, conn)
            except (ValueError, DescriptorError) as exc:
                raise Refused(f"tables: {exc}") from exc
            lslots, rslots = pairs.slots(ltab, rtab)
            _copy(ltab, rtab, lslots, rslots)
        wrote.append({name: {int(a): int(b) for a, b in zip(local[d.config.group_index(name)],
                                                            remote[d.config.group_index(name)])}
                      for name in d.caches})
    return P, D, wrote


def _root(t: np.ndarray) -> np.ndarray:
    while t.base is not None:
        t = t.base
    return t


def expected(case: Case, d: Rank, wrote: dict[str, dict[int, int]]) -> dict[int, np.ndarray]:
    """Each of ``d``'s allocations (by ``id`` of its root array) as the
    reference says it must be: the sentinel, and in every block a load
    wrote, per layer, the producer's values of this rank's heads of the
    producer's block paired with it."""
    shadows: dict[int, np.ndarray] = {}
    for li, (name, view) in enumerate(d.logical.items()):
        root = _root(d.caches[name])
        shadow = shadows.setdefault(id(root), np.full(root.shape, SENTINEL, dtype=root.dtype))
        offset = view.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        mirror = np.ndarray(view.shape, view.dtype, buffer=shadow, offset=offset, strides=view.strides)
        ids = wrote[name]
        if ids:
            lb = np.fromiter(ids.keys(), dtype=np.int64)
            rb = np.fromiter(ids.values(), dtype=np.int64)
            v = values(case, li, d.heads[name], rb, view.itemsize)
            mirror.view(v.dtype)[lb] = v
    return shadows


def check(case: Case, seed: int = 0) -> str | None:
    """None when every decode rank's every byte is what the reference says,
    or the product's reason for refusing the pair. Fails on a wrong byte."""
    try:
        _, D, wrote = load(case, seed)
    except Refused as exc:
        return str(exc)
    for d, w in zip(D, wrote):
        want = expected(case, d, w)
        seen = set()
        for name, t in d.caches.items():
            root = _root(t)
            if id(root) in seen:
                continue
            seen.add(id(root))
            got, ref = root.view(np.uint8), want[id(root)].view(np.uint8)
            if not np.array_equal(got, ref):
                bad = np.flatnonzero(got.reshape(-1) != ref.reshape(-1))
                raise AssertionError(f"{case}: decode rank {d.rank}, allocation of {name}: {bad.size} of "
                                     f"{got.size} bytes wrong after a load the product accepted "
                                     f"(first at byte {bad[0]})")
    return None


def documented_to_work(case: Case) -> bool:
    """The pairs docs/rdma-connector.md says are moved (not refused)."""
    if case.layout == "mla":
        return True
    heads = {g.heads for g in case.groups}
    H = case.total_kv_heads
    if heads != {H}:
        return False
    if len(case.groups) > 1 and case.p_tp != case.d_tp and H < 2 * min(case.p_tp, case.d_tp):
        return False  # one head per rank: a group's own heads cannot be told from the model's
    if any(H % t and t % H for t in (case.p_tp, case.d_tp)):
        return False
    sliced = max(1, H // case.d_tp) != max(1, H // case.p_tp)
    return not sliced or case.layout in SLICEABLE


def _divisor_tps(heads: int) -> list[int]:
    return [t for t in (1, 2, 3, 4, 6, 8) if heads % t == 0 or t % heads == 0]


@st.composite
def cases(draw) -> Case:
    layout = draw(st.sampled_from(LAYOUTS + ("mla",)))
    H = 1 if layout == "mla" else draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    tps = _divisor_tps(H) if layout != "mla" else [1, 2, 3, 4]
    p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    bs = draw(st.sampled_from([4, 8, 16]))
    hybrid = layout != "mla" and draw(st.booleans())
    groups = (Group(H, None),)
    if hybrid:
        window = draw(st.integers(1, 3 * bs))
        # A sliding-window group with its own KV heads (MiMo-V2's swa_num_key_value_heads)
        H1 = draw(st.sampled_from([h for h in (H, 2 * H, max(1, H // 2)) if all(h % t == 0 or t % h == 0
                                                                                    for t in (p_tp, d_tp))]))
        groups = (Group(H, None), Group(H1, window)) if draw(st.booleans()) else (Group(H1, window), Group(H, None))
    return Case(total_kv_heads=H, groups=groups, layers_per_group=draw(st.integers(1, 2)), p_tp=p_tp, d_tp=d_tp,
                layout=layout, dtype=draw(st.sampled_from(["float16", "float32", "uint8"])),
                head_size=draw(st.sampled_from([2, 4, 8])), block_size=bs, shared=draw(st.booleans()),
                num_tokens=draw(st.integers(1, 5 * bs)))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases())
def test_every_byte_a_decode_rank_loads_is_its_heads_of_the_right_block(case):
    refused = check(case)
    if documented_to_work(case):
        assert refused is None, f"{case}: refused a pair the docs say is moved: {refused}"


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [
    (2, 1, 4), (1, 2, 4), (4, 2, 8), (2, 4, 8), (2, 3, 6), (3, 2, 6), (4, 6, 12), (1, 2, 1), (4, 1, 2),
    (8, 2, 4), (2, 8, 4),
])
@pytest.mark.parametrize("layout", SLICEABLE)
def test_documented_pairs_are_moved_byte_exact(p_tp, d_tp, heads, layout):
    for hybrid in (False, True) if heads >= 2 * min(p_tp, d_tp) else (False,):
        groups = (Group(heads, None), Group(heads, 6)) if hybrid else (Group(heads, None),)
        case = Case(heads, groups, 2, p_tp, d_tp, layout, "float16", 4, 4, shared=hybrid, num_tokens=15)
        assert check(case, seed=p_tp * 10 + d_tp) is None


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "swa_heads"), [
    (8, 16, 4, 8),  # every rank holds one head of each group: the SWA heads were read from the wrong ranks
    (2, 6, 1, 2),
    (2, 3, 6, 12),  # non-nested TP sizes: head slices of a group with twice the heads
    (4, 2, 8, 4),
])
def test_a_group_with_kv_heads_of_its_own_is_refused_between_tp_sizes(p_tp, d_tp, heads, swa_heads):
    """A hybrid model whose sliding-window layers have their own KV heads
    (MiMo-V2's ``swa_num_key_value_heads``): one rank plan, made from the
    model's KV heads, cannot serve both groups. Before, P8 -> D16 with 4 and
    8 KV heads (one head per rank in either group, same shapes everywhere)
    loaded the sliding-window layers' KV of other heads, and reported success."""
    groups = (Group(heads, None), Group(swa_heads, 32))
    case = Case(heads, groups, 2, p_tp, d_tp, "cpu", "float16", 4, 16, shared=True, num_tokens=60)
    refused = check(case)
    assert refused is not None and refused.startswith("plan: "), refused
    assert "equal" in refused
    # Equal TP sizes read whole blocks rank for rank: moved, byte for byte.
    assert check(dataclasses.replace(case, p_tp=d_tp)) is None
