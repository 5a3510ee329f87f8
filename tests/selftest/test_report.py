"""The selftest's report: one line per check, the JSON shape, the exit
status (no process, no UCX)."""

from __future__ import annotations

import json

import pytest

from rdma_kv.selftest import Check, Status, exit_status, render, summary, to_json, write_json
from rdma_kv.selftest.report import from_wire

CHECKS = [Check.passed("host.read", "bit-exact; 2.00 GB/s", gbps=2.0, nbytes=4096),
          Check.skipped("cuda", "no GPU driver on this host"),
          Check.failed("nic:mlx5_9:1", "UCX reports no such device")]


def test_json_is_a_list_of_checks_with_their_figures_beside_name_status_and_detail(tmp_path):
    path = tmp_path / "selftest.json"
    write_json(CHECKS, path)
    data = json.loads(path.read_text())
    assert data == to_json(CHECKS)
    assert list(data) == ["checks"]
    assert data["checks"][0] == {"name": "host.read", "status": "PASS", "detail": "bit-exact; 2.00 GB/s",
                                 "gbps": 2.0, "nbytes": 4096}
    assert [c["status"] for c in data["checks"]] == ["PASS", "SKIP", "FAIL"]
    assert [from_wire(c) for c in data["checks"]] == CHECKS  # what a check process sends, read back


def test_exit_status_is_1_only_when_something_failed():
    assert exit_status(CHECKS) == 1
    assert exit_status(CHECKS[:2]) == 0
    assert exit_status([]) == 0
    assert summary(CHECKS) == "selftest: 1 PASS, 1 FAIL, 1 SKIP"
    assert summary(CHECKS[:2]).endswith("(nothing failed)")
    unexercised = [Check.skipped("nic:eth0", "NIC not exercised: ...", exercised=False),
                   Check.skipped("nic:eth1", "NIC not exercised: ...", exercised=False)]
    assert summary(CHECKS + unexercised) == ("selftest: 1 PASS, 1 FAIL, 3 SKIP (not exercised: nic:eth0, nic:eth1, "
                                             "see their lines)")
    assert exit_status(CHECKS[:2] + unexercised) == 0  # SKIPs, as on any host that cannot check something


def test_a_line_says_status_name_and_reason():
    assert render(CHECKS[1]) == f"SKIP  {'cuda':<24} no GPU driver on this host"


def test_a_malformed_record_is_refused_naming_it():
    with pytest.raises(ValueError, match="malformed check record"):
        from_wire({"name": "x", "status": "MAYBE", "detail": ""})
    assert Status("SKIP") is Status.SKIP
