"""A push-mode decode introduces its KV cache (PUSH_HELLO: its worker
address and the remote keys to write its whole cache) only to a producer
it can trust: one that proved the shared secret, one on this machine's
loopback, or any where the operator said the network is trusted
(``allow_unauthenticated``). A decode's producers come from the request's
``kv_transfer_params``, which any client of the decode server writes: before,
a decode without a secret handed its write keys to whatever answered at
the address a client named (found by a review of the docs against the
code: security.md said a consumer sends its keys to no one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rdma_kv.connector.rdma.consumer.pushes import PushFailed, Pushes


class Reached(Exception):
    """The decode went on to build its PUSH_HELLO (it read its transport's metadata)."""


class Client:
    def __init__(self, host: str, authenticated: bool) -> None:
        self.host, self.port, self.authenticated = host, 14579, authenticated
        self.sent: list[object] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def call(self, request, timeout_s=None):
        self.sent.append(request)
        raise AssertionError("nothing may be sent before the check")


def _metadata():
    raise Reached


def hello(client: Client, allow_unauthenticated: bool = False) -> None:
    settings = SimpleNamespace(allow_unauthenticated=allow_unauthenticated, rpc_timeout_s=2.0)
    local = SimpleNamespace(transport=SimpleNamespace(metadata=_metadata), rank=0, geometry=None)
    pushes = Pushes(local, "D", 1, b"i" * 8, settings, SimpleNamespace(), lambda peer, why: None,
                    lambda heads: (None, None))
    pushes._hello("P/tp0#1", client, b"L" * 8)  # the link: the transport peer of a handshake, and its life


def test_no_secret_no_write_keys_to_a_producer_off_this_machine():
    client = Client("10.1.2.3", authenticated=False)
    with pytest.raises(PushFailed, match="no shared secret") as exc:
        hello(client)
    assert "10.1.2.3:14579" in str(exc.value) and "allow_unauthenticated" in str(exc.value)
    assert client.sent == []
    with pytest.raises(PushFailed, match="no shared secret"):
        hello(Client("producer.example", authenticated=False))  # a name may resolve anywhere


@pytest.mark.parametrize(("host", "authenticated", "allow"), [
    ("10.1.2.3", True, False),  # the producer proves the secret at the opening
    ("10.1.2.3", False, True),  # the operator trusts the network
    ("127.0.0.1", False, False),  # this machine
    ("::1", False, False),
    ("localhost", False, False),
])
def test_a_producer_the_decode_can_trust_is_introduced(host, authenticated, allow):
    with pytest.raises(Reached):
        hello(Client(host, authenticated), allow_unauthenticated=allow)
