"""Trust earned by a lease (no secret): a lease vouches for a bounded number
of connections, trust lapses with the lease, another proven live lease
takes over (no sockets)."""

from __future__ import annotations

from rdma_kv.connector.rdma.sidetrust import LEASE_VOUCHES, LeaseTrust

A, B = (1, 1), (1, 2)


def trust(live):
    return LeaseTrust(lambda leases: any(lease in live for lease in leases))


def test_one_lease_vouches_for_a_bounded_number_of_connections():
    live = {A}
    t = trust(live)
    made = [t.prove(f"c{i}", {A}) for i in range(LEASE_VOUCHES + 5)]
    assert made == [True] * LEASE_VOUCHES + [False] * 5
    t.forget("c0")  # one closes: its vouch is free again
    assert t.prove("late", {A}) is True


def test_no_trust_from_a_lease_the_table_does_not_hold():
    t = trust(set())
    assert t.prove("c", {A}) is False and "c" not in t


def test_trust_lapses_with_its_lease_unless_another_proven_one_lives():
    live = {A, B}
    t = trust(live)
    assert t.prove("one", {A}) and t.prove("both", {A})
    assert t.prove("both", {B}) is False  # already trusted: B is remembered, not counted
    live.discard(A)
    assert t.lapsed() == ["one"]  # "both" moved to B
    assert "both" in t and "one" not in t
    live.discard(B)
    assert t.lapsed() == ["both"] and t.lapsed() == []
