"""UCP context and worker: cold-path calls through cffi.

A ``Context`` owns its ``Worker``; ``Worker.close()`` must run before
``Context.close()`` (the agent tears down in that order). Neither class is
thread-safe on its own: the agent serialises every call with its lock, which
is why a polling agent's worker is created in ``UCS_THREAD_MODE_SERIALIZED``.
A worker progressed by a C thread (the shim's pump: progress="thread", and
lanes) while Python posts on it is created in ``UCS_THREAD_MODE_MULTI``
(UCX's own worker lock), and so is the own worker of an agent with lanes:
a lane's pump may send a striped transfer's notification on it.

May import: rdma_kv.errors, rdma_kv.transport._lib.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from rdma_kv.errors import ClosedError, ConfigError
from rdma_kv.transport._lib import check_status, load, status_name

log = logging.getLogger(__name__)


# Applied unless the operator sets UCX_<NAME> or passes the option. Measured
# here (two processes, CMA): with UCX's defaults a 32 KiB ucp_get_nbx is not
# sent as one process_vm_readv and 16,384 of them ran at 0.7-0.9 GB/s; with
# RNDV_THRESH=inf each get is one CMA zero-copy read (4.5-5.6 GB/s).
# MAX_RMA_RAILS=2 lets large gets stripe over two lanes (two HCA ports on IB).
# MAX_HCA_PER_GPU=auto registers GPU memory only on the HCAs closest to the
# GPU (UCX >= 1.21; its default registers it on every HCA of the node), and
# IB_PCI_RELAXED_ORDERING=try enables PCIe relaxed ordering where the HCA
# supports it (an option of UCX's IB module: unknown to a UCX without verbs,
# such as the libucx wheel). NIXL's UCX backend sets the same values.
# CUDA_IPC_ENABLE_GET_ZCOPY=y: UCX's default ("auto") turns cuda_ipc's get
# off on a node without NVLink, and a GPU -> GPU ucp_get between processes
# then falls to software emulation over TCP. Measured on one H200 (no
# NVLink), libucx-cu12 1.22, the selftest's reads: 0.31-0.49 GB/s over
# tcp/lo with the default; with get zero-copy, cuda_ipc carries them at
# 167-228 GB/s (2 MiB runs), 43 GB/s (256 KiB random blocks), 2.9 GB/s
# (16 KiB random blocks) (docs/deploy.md, section 10). Pull is made of
# gets, so rdma-kv asks for them; unknown to a UCX without CUDA (skipped).
# TCP_PUT_ENABLE=n: UCX's TCP transport then carries a put as active
# messages the target applies, instead of its native put zero-copy, which
# waits for the target's acknowledgement. With libucx-cu12 1.22's native
# put, a writer crashed (a segfault in uct_tcp_iface_handle_events on a
# closed TCP endpoint, or heap corruption) when a deadline had force-closed
# an endpoint with puts in flight and the peer then closed its side: in
# every two-process run of 25 rounds here, against none in 100 rounds
# with this setting (docs/reliability.md, "A TCP writer crashed"). Only
# where TCP carries the data: InfiniBand, RoCE, shared memory and CMA are
# not affected.
DEFAULT_OPTIONS = {"RNDV_THRESH": "inf", "MAX_RMA_RAILS": "2", "MAX_HCA_PER_GPU": "auto",
                   "IB_PCI_RELAXED_ORDERING": "try", "CUDA_IPC_ENABLE_GET_ZCOPY": "y",
                   "TCP_PUT_ENABLE": "n"}


def effective_options(options: Mapping[str, str] | None) -> dict[str, str]:
    """DEFAULT_OPTIONS minus those the environment sets, plus ``options``."""
    merged = {k: v for k, v in DEFAULT_OPTIONS.items() if f"UCX_{k}" not in os.environ}
    merged.update(options or {})
    return merged


NOT_SET = ("TLS", "NET_DEVICES")
"""Settings whose UCX default is ``all`` (every transport, every device):
``ucx_setting`` says None for them when that holds."""


def ucx_config(options: Mapping[str, str] | None = None) -> dict[str, str]:
    """UCX's settings (no ``UCX_`` prefix) as a ``Context(options)`` reads
    them, from UCX itself (``ucp_config_print``): its defaults, then its
    configuration files (``ucx.conf``: the installation's, the one in
    ``UCX_CONFIG_DIR``, the current directory's), then ``UCX_*`` variables,
    then rdma-kv's defaults and ``options`` (``effective_options``). Reading
    ``os.environ`` alone missed ``ucx.conf``: `rdma-kv info` said
    "UCX_TLS unset: all" for a host whose ucx.conf names ``tcp``."""
    ffi, lib = load()
    config, _ = _read_config(ffi, lib, options)
    text, size = ffi.new("char **"), ffi.new("size_t *")
    try:
        stream = lib.open_memstream(text, size)
        if stream == ffi.NULL:
            raise OSError(ffi.errno, "open_memstream failed")
        lib.ucp_config_print(config, stream, ffi.NULL, lib.UCS_CONFIG_PRINT_CONFIG)
        lib.fclose(stream)
        printed = ffi.string(text[0], size[0]).decode(errors="replace")
    finally:
        lib.ucp_config_release(config)
        if text[0] != ffi.NULL:
            lib.free(text[0])
    settings = {}
    for line in printed.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("UCX_"):
            settings[key[4:]] = value
    return settings


def ucx_setting(options: Mapping[str, str] | None, key: str) -> str | None:
    """The value of UCX setting ``key`` (no ``UCX_`` prefix, as ``TLS``) in
    a ``Context(options)``: ``options``' own, rdma-kv's default unless the
    environment sets it, the environment's, as written; else as UCX reads
    it (``ucx_config``: a configuration file, UCX's default); None where
    UCX's default ``all`` holds unset (``TLS``, ``NET_DEVICES``) or UCX has no
    such setting."""
    # As written: options', rdma-kv's default the environment leaves, the environment's (UCX prints them expanded).
    value = effective_options(options).get(key, os.environ.get(f"UCX_{key}"))
    if value is not None:
        return value
    value = ucx_config(options).get(key)
    return None if value is None or (key in NOT_SET and value == "all") else value


def ucx_setting_source(options: Mapping[str, str] | None, key: str) -> str:
    """Where a ``Context(options)``'s ``key`` comes from, for messages:
    ``ucx_options['KEY']``, ``UCX_KEY`` (the environment), rdma-kv's
    default, a UCX configuration file, or UCX's default."""
    if key in (options or {}):
        return f"ucx_options[{key!r}]"
    if f"UCX_{key}" in os.environ:
        return f"UCX_{key}"
    if key in DEFAULT_OPTIONS:
        return f"rdma-kv's default {key}"
    if key in NOT_SET and ucx_setting(options, key) is not None:
        return f"UCX_{key} of a UCX configuration file (ucx.conf)"
    return f"UCX_{key} unset (UCX's default)"


def _read_config(ffi: Any, lib: Any, options: Mapping[str, str] | None) -> tuple[Any, list[str]]:
    """A ``ucp_config_t`` as UCX reads it, with ``effective_options(options)``
    applied, and the rdma-kv defaults this UCX rejected (its version, or a
    module it was built without: UCX's own default stays). The caller
    releases it (``ucp_config_release``)."""
    config_p = ffi.new("ucp_config_t **")
    check_status(lib.ucp_config_read(ffi.NULL, ffi.NULL, config_p), "ucp_config_read")
    config, skipped = config_p[0], []
    try:
        for key, value in effective_options(options).items():
            status = lib.ucp_config_modify(config, key.encode(), str(value).encode())
            if status != lib.UCS_OK and key not in (options or {}):
                log.debug("UCX default %s=%s not applied: %s", key, value, status_name(status))
                skipped.append(key)
            elif status != lib.UCS_OK:
                raise ConfigError(
                    f"UCX option {key}={value!r} rejected: {status_name(status)}; "
                    "options are UCX settings without the UCX_ prefix "
                    "(see `ucx_info -c` for the valid names and values)"
                )
    except BaseException:
        lib.ucp_config_release(config)
        raise
    return config, skipped


class Context:
    """A UCP context with RMA, active messages and wakeup.

    ``options`` are UCX configuration settings without the ``UCX_`` prefix
    (``{"TLS": "tcp", "NET_DEVICES": "mlx5_0:1"}``); they are applied to this
    context only, never to the process environment. ``UCX_*`` environment
    variables apply underneath, as everywhere in UCX, and take precedence
    over rdma-kv's ``DEFAULT_OPTIONS``. UCX's configuration files
    (``ucx.conf``) apply under both: a ``DEFAULT_OPTIONS`` key a ucx.conf
    sets gets rdma-kv's value (UCX does not say which file set what; set
    it in ``UCX_*`` or ``options`` to keep it; ``docs/deploy.md`` section 2).
    """

    def __init__(self, options: Mapping[str, str] | None = None, name: str = "rdma-kv",
                 shared_workers: bool = False) -> None:
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        config, self.skipped_defaults = _read_config(ffi, lib, options)  # (defaults this UCX rejected)
        try:
            params = ffi.new("ucp_params_t *")
            params.field_mask = lib.UCP_PARAM_FIELD_FEATURES | lib.UCP_PARAM_FIELD_NAME
            params.features = lib.UCP_FEATURE_RMA | lib.UCP_FEATURE_AM | lib.UCP_FEATURE_WAKEUP
            self._name = ffi.new("char[]", name.encode())
            params.name = self._name
            if shared_workers:  # workers of this context run on different threads
                params.field_mask |= lib.UCP_PARAM_FIELD_MT_WORKERS_SHARED
                params.mt_workers_shared = 1
            handle = ffi.new("ucp_context_h *")
            check_status(lib.ucp_init(params, config, handle), "ucp_init")
        finally:
            lib.ucp_config_release(config)
        self.handle = handle[0]

    @property
    def closed(self) -> bool:
        return self.handle is None

    def require_open(self) -> None:
        if self.handle is None:
            raise ClosedError("the UCP context is closed; create a new Agent")

    def memory_types(self) -> int:
        """Bitmask of ``ucs_memory_type_t`` values this context supports."""
        self.require_open()
        attr = self._ffi.new("ucp_context_attr_t *")
        attr.field_mask = self._lib.UCP_ATTR_FIELD_MEMORY_TYPES
        check_status(self._lib.ucp_context_query(self.handle, attr), "ucp_context_query")
        return int(attr.memory_types)

    def close(self) -> None:
        if self.handle is not None:
            self._lib.ucp_cleanup(self.handle)
            self.handle = None

    def abandon(self) -> None:
        """Forget the context without cleaning it up (a worker of it was abandoned)."""
        self.handle = None


# How long closing a worker progresses it for what its endpoints still have
# queued to go out: UCX 1.22's ucp_worker_destroy purges such requests as if
# they were sends of the user's (ucp_request_send_state_ff), and those UCX
# made itself to answer a peer over TCP, a get's reply and a software put's
# completion (rma_sw.c: flags 0, send.datatype never set), are then never
# released (a leak), and a stale datatype of a recycled request sends the
# purge through memory handles they never had (a segfault in
# ucp_request_dt_dereg). A gracefully closed endpoint to a connected peer
# lives on until the destroy and goes on answering, so the endpoints' own
# closes cannot drain it. Milliseconds with a peer that reads; the bound is
# for one that reads nothing (docs/reliability.md, "Reviews of the TCP
# target's close").
DRAIN_WAIT_S = 2.0


# The most endpoints from one worker to another that UCX pairs: its sequence
# numbers are 16 bits, and from 0xFFFF on it matches none (ucp_ep_match.h).
MAX_PAIRED_ENDPOINTS = 0xFFFF


class Worker:
    """A UCP worker with an event fd for sleeping progress."""

    def __init__(self, context: Context, multi_thread: bool = False) -> None:
        context.require_open()
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        params = ffi.new("ucp_worker_params_t *")
        params.field_mask = (
            lib.UCP_WORKER_PARAM_FIELD_THREAD_MODE | lib.UCP_WORKER_PARAM_FIELD_EVENTS
        )
        params.thread_mode = lib.UCS_THREAD_MODE_MULTI if multi_thread else lib.UCS_THREAD_MODE_SERIALIZED
        params.events = lib.UCP_WAKEUP_RMA | lib.UCP_WAKEUP_TX | lib.UCP_WAKEUP_RX
        handle = ffi.new("ucp_worker_h *")
        check_status(lib.ucp_worker_create(context.handle, params, handle), "ucp_worker_create")
        self.handle = handle[0]
        fd = ffi.new("int *")
        check_status(lib.ucp_worker_get_efd(self.handle, fd), "ucp_worker_get_efd")
        self.efd = int(fd[0])
        addr_p = ffi.new("ucp_address_t **")
        len_p = ffi.new("size_t *")
        check_status(
            lib.ucp_worker_get_address(self.handle, addr_p, len_p), "ucp_worker_get_address"
        )
        self.address = bytes(ffi.buffer(addr_p[0], len_p[0]))
        lib.ucp_worker_release_address(self.handle, addr_p[0])
        # Endpoints a peer's close left open while flushes of them were
        # outstanding (peer.py: closed once those end, else with the worker).
        self.left_open: list[Any] = []
        # How many endpoints this worker made to each remote worker (by a
        # digest of its address): UCX numbers them so, and pairs the n-th with
        # the n-th the remote worker makes back (``count_endpoint``).
        self._made: dict[bytes, int] = {}

    @staticmethod
    def _key(address: bytes) -> bytes:
        return hashlib.blake2b(address, digest_size=16).digest()

    def count_endpoint(self, address: bytes) -> int:
        """Count one more endpoint made to the worker at ``address``; returns
        its number (1 for the first; -1 once the count is not known). UCX
        numbers a worker's endpoints to one remote worker in the order they
        are made (``ucp_ep_create``: its connection sequence number, 16 bits)
        and pairs the n-th with the remote's n-th to this worker: one
        connection.

        Kept for the worker's life, as UCX keeps its own number per remote
        worker (``ucs_conn_match``: freed only when the worker is destroyed):
        a count forgotten would read as 0, the next paired import would be
        numbered from there, and the remote's fence would reach nothing
        (an earlier bounded table lost a live peer's count so: a review's
        test, ``tests/transport/test_fence.py``). About 100 bytes per remote
        worker, of the order of what UCX itself holds for it."""
        key = self._key(address)
        n = self._made.get(key, 0)
        n = n + 1 if n >= 0 else -1
        self._made[key] = n
        return n

    def lose_count(self, address: bytes) -> None:
        """A ``ucp_ep_create`` to ``address`` failed: UCX may have taken a
        sequence number for it or not, so this worker's count of endpoints to
        that worker, and the pairing it stands for, is no longer known."""
        self._made[self._key(address)] = -1

    def endpoints_made(self, address: bytes) -> int:
        """How many endpoints this worker made to the worker at ``address``
        (-1: not known since a ``ucp_ep_create`` to it failed)."""
        return self._made.get(self._key(address), 0)

    def progress(self, max_rounds: int = 1024) -> int:
        return int(self._lib.rk_progress(self.handle, max_rounds))

    def arm(self) -> bool:
        """Arm the event fd; False when events are pending (progress again)."""
        status = self._lib.ucp_worker_arm(self.handle)
        if status == self._lib.UCS_ERR_BUSY:
            return False
        check_status(status, "ucp_worker_arm")
        return True

    def signal(self) -> None:
        """Wake a thread sleeping on the event fd (thread-safe in UCX)."""
        if self.handle is not None:
            self._lib.ucp_worker_signal(self.handle)

    def drain(self) -> bool:
        """Progress until nothing waits to go out on any endpoint (at most
        ``DRAIN_WAIT_S``); False, logged, if something still did then.

        Done once a worker flush completes in place: UCX does that only when
        none of the worker's interfaces has anything outstanding
        (``ucp_worker_flush_check``; over TCP, no endpoint's send buffer
        holds unsent bytes, which every request in an endpoint's queue
        waits behind). A flush that has to be waited for progresses the
        worker, which answers what arrives meanwhile: flush again."""
        ffi, lib = self._ffi, self._lib
        param = ffi.new("ucp_request_param_t *")  # no callback: the request is waited for
        end = time.monotonic() + DRAIN_WAIT_S
        waited = 0
        while True:
            req = lib.ucp_worker_flush_nbx(self.handle, param)
            if req == ffi.NULL:
                if waited:
                    log.debug("worker drained before its destroy after %d flush(es)", waited)
                return True
            waited += 1
            status = lib.rk_wait_request(self.handle, req, max(0, int((end - time.monotonic()) * 1e9)))
            if status != lib.UCS_OK:
                log.warning("destroying a UCP worker with something still outstanding on it (%s after %.1f s, "
                            "%d flush(es)): a peer that does not read, or a connection in progress; UCX purges "
                            "requests still queued, and can leak or crash on answers to a peer's reads "
                            "(docs/reliability.md)", status_name(status), DRAIN_WAIT_S, waited)
                return False

    def close(self) -> None:
        if self.handle is not None:
            self.drain()
            self._lib.ucp_worker_destroy(self.handle)  # with every endpoint still open on it
            self.handle = None
            self.left_open.clear()

    def abandon(self) -> None:
        """Forget the worker without destroying it: a thread stuck inside it
        would use it after it was freed (the memory is lost)."""
        self.handle = None
