"""The one error hierarchy of rdma-kv.

Every class also derives from the builtin a caller would catch anyway
(``ConfigError`` is a ``ValueError``, ``TransferTimeoutError`` a
``TimeoutError``), so code that does not know rdma-kv still handles it.
Subclasses exist only where callers branch on them. Messages say what
failed, which ids, expected vs got, and what to do.

Imports nothing from rdma-kv; every layer may import it.
"""

from __future__ import annotations


class RdmaKVError(Exception):
    """Base of every error raised by rdma-kv."""


# --- configuration and caller input -------------------------------------


class ConfigError(RdmaKVError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class SpecError(RdmaKVError, ValueError):
    """KV-cache specs are inconsistent (e.g. merging incompatible specs)."""


class DescriptorError(RdmaKVError, ValueError):
    """A descriptor lies outside every registered region, or lists disagree."""


class RegistrationError(RdmaKVError, ValueError):
    """Memory cannot be registered (unsupported object, overlap, bad range)."""


# --- peers and the wire ---------------------------------------------------


class MetadataError(RdmaKVError, ValueError):
    """Peer metadata is malformed, truncated or of an incompatible version."""


class PeerError(RdmaKVError, ConnectionError):
    """A peer is unknown, unreachable, or its endpoint failed."""


class PeerTimeout(PeerError):
    """A peer did not answer in time: it accepted and stayed silent, or its
    address dropped the connect. Stalled or starved of CPU, not known to be
    gone (a refused or reset connection is a plain :class:`PeerError`).

    ``answered_before``: the peer answered a call of this client before
    this one, so it is a live producer that stalls, not an address that
    never answered (a port a request named that accepts and never
    answers, a host that is not there)."""

    def __init__(self, message: str, *, answered_before: bool = False) -> None:
        super().__init__(message)
        self.answered_before = answered_before


class HandshakeError(PeerError):
    """The handshake with a peer failed or was refused."""


class AuthenticationError(HandshakeError):
    """The peer failed (or refused) shared-secret authentication."""


# --- transfers --------------------------------------------------------------


class TransferError(RdmaKVError, RuntimeError):
    """A transfer failed; ``status`` holds UCX's status text when known
    (``ucs_status_string()``, e.g. "Connection reset by remote peer")."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its deadline."""


class UCXError(RdmaKVError, RuntimeError):
    """A UCX call returned an error status."""

    def __init__(self, message: str, status: int = 0, status_name: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.status_name = status_name


class UCXUnavailableError(UCXError, ImportError):
    """The UCX libraries or the compiled shim cannot be loaded."""


# --- life cycle ---------------------------------------------------------------


class ClosedError(RdmaKVError, RuntimeError):
    """An object was used after ``close()``."""


class RoleError(RdmaKVError, RuntimeError):
    """A connector method was called on the wrong role (scheduler vs worker)."""


class NotInitializedError(RdmaKVError, RuntimeError):
    """Global KV-transfer state was used before it was initialized."""


class ConnectorLoadError(RdmaKVError, ImportError):
    """A connector cannot be found, imported, or is not a connector class."""
