"""Trust earned by a lease (no secret): a lease vouches for a bounded number
of connections, trust lapses with the lease, another proven live lease
takes over (no sockets)."""

from __future__ import annotations

from rdma_kv.connector.rdma.sidetrust import LEASE_VOUCHES, MAX_PROOFS, LeaseTrust

A, B = (1, 1), (1, 2)


class Table:
    """The lease table's ``live``: counts its looks (each takes a real table's
    lock once) and the leases looked at."""

    def __init__(self, live):
        self.live, self.looks, self.looked = live, 0, []

    def __call__(self, leases):
        leases = list(leases)
        self.looks += 1
        self.looked += leases
        return {lease for lease in leases if lease in self.live}


def trust(live):
    return LeaseTrust(Table(live))


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


def test_a_connection_remembers_its_last_proofs_only():
    live = {(1, g) for g in range(1, 1001)}
    t = trust(live)
    assert t.prove("c", set(live))
    assert t.proofs("c") == MAX_PROOFS
    t.prove("c", {(1, 1000)})
    assert t.proofs("c") == MAX_PROOFS  # the last one proven is kept, an older one forgotten


def test_a_lapse_looks_at_the_table_once_per_connection_and_forgets_what_it_found_dead():
    live = {(1, g) for g in range(1, MAX_PROOFS + 1)}
    table = Table(live)
    t = LeaseTrust(table)
    for conn in ("c0", "c1", "c2"):
        assert t.prove(conn, set(live) - {(1, MAX_PROOFS)})
        t.prove(conn, {(1, MAX_PROOFS)})  # proven last: the one that outlives the others
    live.intersection_update({(1, MAX_PROOFS)})
    table.looks = 0
    assert t.lapsed() == []  # each moved to the lease it proved last
    assert table.looks == 1 + 3  # the vouchers, then each connection's proofs in one look
    assert all(t.proofs(conn) == 1 for conn in ("c0", "c1", "c2"))  # the dead ones are forgotten
    live.clear()
    table.looks, table.looked = 0, []
    assert sorted(t.lapsed()) == ["c0", "c1", "c2"]
    assert table.looks == 1 and table.looked == [(1, MAX_PROOFS)]  # nothing found dead is looked at again
    assert t.lapsed() == [] and table.looks == 1  # nobody trusted: no look at all
