"""What a ``nic:<device>`` loopback read proves, and the line it gets.

Over ``tcp`` the two processes of the check connect to the device's own
address, and the kernel routes that over the loopback device: not one byte
crosses the NIC (measured here: eth0 sent 0 bytes, lo 8.49 MB for a 4 MiB
read), so a NIC whose link is down reads the same. Such a device is SKIP,
"NIC not exercised", named in the summary line; before, it PASSed
("loopback through eth0", exit status 0). Over verbs the HCA loops the read
back itself: a PASS that says it proves the HCA, not the link or switch. A
read that fails is a FAIL whatever the transport; ``tcp`` on the loopback
device itself (``lo``) PASSes (tests/selftest/test_selftest_run.py).

The read itself, through eth0 on this host, is in test_selftest_run.py."""

from __future__ import annotations

from rdma_kv.selftest import Check, Status, exit_status, summary
from rdma_kv.selftest.groups import nic_verdict

READ = Check.passed("nic:eth0", "loopback through eth0 (TLS=tcp): 4 MiB ...; bit-exact; 0.74 GB/s",
                    gbps=0.74, nbytes=4 << 20, ucx_protocol="software emulation tcp/eth0")


def test_a_tcp_read_through_a_nic_is_a_skip_not_exercised_named_in_the_summary():
    check = nic_verdict(READ, "eth0", "tcp", ["lo"], {"eth0": 0, "lo": 8_485_433})
    assert check.status is Status.SKIP and check.name == "nic:eth0"
    assert check.detail.startswith("NIC not exercised: over tcp the reader connects to eth0's own address, which "
                                   "the kernel routes over the loopback device (during the read eth0 sent 0, lo sent "
                                   "8,485,433 bytes)")
    assert READ.detail in check.detail and "between two hosts" in check.detail  # what ran, what to do
    assert check.figures["exercised"] is False and check.figures["tx_bytes_during_read"] == {"eth0": 0, "lo": 8_485_433}
    assert check.figures["nbytes"] == 4 << 20  # the read's own figures kept
    checks = [Check.passed("host.read", "bit-exact"), check]
    assert summary(checks) == "selftest: 1 PASS, 0 FAIL, 1 SKIP (nothing failed; not exercised: nic:eth0, see its line)"
    assert exit_status(checks) == 0  # a SKIP, as every check this host cannot make


def test_a_read_over_verbs_passes_saying_what_an_hca_loopback_does_not_prove():
    read = Check.passed("nic:mlx5_0:1", "loopback through mlx5_0:1 (TLS=rc,ud): ...; bit-exact", nbytes=1)
    check = nic_verdict(read, "mlx5_0:1", "rc,ud", ["lo"], {})
    assert check.status is Status.PASS and check.detail.startswith(read.detail)
    assert "not its link, cable or switch" in check.detail and check.figures == read.figures


def test_a_failed_read_fails_and_the_loopback_device_passes_as_it_is():
    failed = Check.failed("nic:eth0", "UCXError: ...")
    assert nic_verdict(failed, "eth0", "tcp", ["lo"], {"eth0": 0}) is failed
    lo = Check.passed("nic:lo", "loopback through lo (TLS=tcp): ...; bit-exact")
    assert nic_verdict(lo, "lo", "tcp", ["lo"], {"lo": 9 << 20}) is lo
