"""Shared-secret peer authentication for the side channel.

Owns the secret (loaded from an environment variable or a file named in
``kv_connector_extra_config``; never stored in config, params or logs) and
the challenge-response proofs both ends of a side-channel connection
compute (``docs/security.md``):

    client proof = HMAC-SHA256(secret, "rdma-kv/sidechannel/client" || server_nonce
                               || client_nonce || version (4 bytes, big-endian) || role)
    server proof = HMAC-SHA256(secret, "rdma-kv/sidechannel/server" || client_nonce
                               || server_nonce || version || role)

Both nonces are fresh random 32-byte values, so neither proof can be
replayed on another connection; the two labels differ, so a proof cannot
be reflected back at its sender. Proofs are compared with
``hmac.compare_digest`` (constant time).

Why the consumer also checks the producer: a producer that cannot prove the
secret could hand out agent metadata pointing at memory of its choosing and
answer HELD to every CONFIRM, i.e. feed the decoder forged KV.

Imports the standard library and ``rdma_kv.errors`` only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat

from rdma_kv.errors import ConfigError

__all__ = ["NONCE_BYTES", "PROOF_BYTES", "Secret", "client_proof", "load_secret", "new_nonce",
           "server_proof"]

logger = logging.getLogger(__name__)

NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
_CLIENT_LABEL = b"rdma-kv/sidechannel/client"
_SERVER_LABEL = b"rdma-kv/sidechannel/server"


class Secret:
    """The shared secret. Its ``repr`` and ``str`` never show the value, so a
    stray log line or traceback cannot leak it."""

    __slots__ = ("_value", "source")

    def __init__(self, value: bytes, source: str) -> None:
        self._value = value
        self.source = source
        """Where it came from (``env:NAME`` or ``file:PATH``): safe to log."""

    def mac(self, message: bytes) -> bytes:
        return hmac.new(self._value, message, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"Secret(<{len(self._value)} bytes from {self.source}>)"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:  # never pickled into another process by accident
        raise TypeError("the side-channel secret cannot be pickled; load it in each process")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _transcript(label: bytes, first: bytes, second: bytes, version: int, role: str) -> bytes:
    return label + first + second + version.to_bytes(4, "big") + role.encode()


def client_proof(secret: Secret, server_nonce: bytes, client_nonce: bytes, version: int,
                 role: str) -> bytes:
    return secret.mac(_transcript(_CLIENT_LABEL, server_nonce, client_nonce, version, role))


def server_proof(secret: Secret, client_nonce: bytes, server_nonce: bytes, version: int,
                 role: str) -> bytes:
    return secret.mac(_transcript(_SERVER_LABEL, client_nonce, server_nonce, version, role))


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)


def _check(value: bytes, source: str) -> bytes:
    value = value.strip()  # files written with `echo` end in a newline
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the side-channel secret from {source} has {len(value)} bytes; at least "
            f"{MIN_SECRET_BYTES} are required (e.g. `openssl rand -hex 32 > secret`)"
        )
    if len(value) > MAX_SECRET_BYTES:
        raise ConfigError(f"the side-channel secret from {source} is over {MAX_SECRET_BYTES} bytes")
    return value


def load_secret(env_name: str | None, file_path: str | None) -> Secret | None:
    """The configured secret, or ``None`` when neither source is configured.

    ``env_name`` (the *name* of an environment variable) wins when that
    variable is set and non-empty; otherwise ``file_path`` is read. A
    configured source that yields nothing is an error, never "no auth": an
    operator who asked for authentication must not silently run without it.
    """
    if not env_name and not file_path:
        return None
    if env_name:
        value = os.environ.get(env_name)
        if value:
            return Secret(_check(value.encode(), f"env:{env_name}"), f"env:{env_name}")
        if not file_path:
            raise ConfigError(
                f"kv_connector_extra_config['auth_secret_env'] names {env_name!r}, which is unset or "
                "empty in this process; export it (in every engine process) or use auth_secret_file"
            )
    assert file_path is not None
    try:
        st = os.stat(file_path)
        with open(file_path, "rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"kv_connector_extra_config['auth_secret_file']: cannot read {file_path!r}: "
            f"{exc.strerror or exc}"
        ) from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        logger.warning("side-channel secret file %s has mode %o: readable by other users; "
                       "chmod 600 it", file_path, stat.S_IMODE(st.st_mode))
    return Secret(_check(raw, f"file:{file_path}"), f"file:{file_path}")
