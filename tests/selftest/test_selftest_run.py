"""``rdma-kv selftest --quick`` on this host, end to end: the UCX checks,
the host-memory reads between two processes (the real agent, prepared
lists, a KV-shaped read and a notified one, bit-exact), CUDA and NICs
skipped with their reasons where the host has neither, the JSON report and
the exit status; a NIC named in the config that UCX does not report is a
FAIL, reported, and makes the exit status 1 while every other check runs.

Deadlines are generous (240 s a group): the host is shared and small."""

from __future__ import annotations

import json

import pytest

from rdma_kv.cli import main
from rdma_kv.selftest import SelftestOptions, Status, run_selftest
from rdma_kv.selftest.pair import kv_workload
from rdma_kv.selftest.run import gpu_driver
from rdma_kv.transport.ucxinfo import VERBS_TRANSPORTS, loaded_ucx, parse_ucx_info, run_ucx_info, ucx_info_binary

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(600)]

DEADLINE = "240"


@pytest.fixture(autouse=True)
def engine_environment(monkeypatch):
    """No UCX_NET_DEVICES from an earlier test in this process (``rdma-kv
    demo`` pins it to lo): here it would name the NIC to check."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)


def has_rdma_nic() -> bool:
    library = loaded_ucx().library
    binary = ucx_info_binary(library)
    transports, _ = parse_ucx_info(run_ucx_info(binary, library)) if binary else ([], set())
    return any(t["transport"] in VERBS_TRANSPORTS for t in transports)


def test_quick_selftest_passes_host_reads_skips_what_is_absent_and_writes_json(tmp_path, capsys):
    path = tmp_path / "selftest.json"
    status = main(["selftest", "--quick", "--timeout", DEADLINE, "--json", str(path)])
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert list(data) == ["checks"]
    checks = {c["name"]: c for c in data["checks"]}
    for c in data["checks"]:
        assert c["status"] in ("PASS", "FAIL", "SKIP") and c["detail"]
        assert f"{c['status']}  {c['name']:<24} {c['detail']}" in out  # one line per check, as printed
    assert status == (1 if any(c["status"] == "FAIL" for c in data["checks"]) else 0)
    assert status == 0, out

    assert checks["ucx.library"]["status"] == "PASS" and checks["ucx.library"]["source"] in ("wheel", "system")
    assert "host" in checks["ucx.transports"]["by_memory_type"]
    want = kv_workload(quick=True)
    for name in ("host.read", "host.read-notified"):
        read = checks[name]
        assert read["status"] == "PASS", read
        assert "bit-exact" in read["detail"] and read["gbps"] > 0
        assert read["nbytes"] == want.transfer_nbytes and read["descriptors"] == want.descriptor_count
    assert "notification delivered" in checks["host.read-notified"]["detail"]

    if gpu_driver() is None:
        assert checks["cuda"]["status"] == "SKIP" and checks["cuda"]["detail"].startswith("no GPU driver on this host")
        assert checks["layout"]["status"] == "SKIP"
    if not has_rdma_nic():
        assert checks["nic"]["status"] == "SKIP" and checks["nic"]["detail"].startswith("no RDMA NIC")
    assert out.rstrip().splitlines()[-2].startswith("selftest: ") and out.rstrip().endswith(f"wrote {path}")


def test_a_configured_nic_is_read_through_and_an_unknown_one_fails_with_exit_status_1(tmp_path, capsys):
    """lo carries a loopback read over tcp here; mlx5_9:1 does not exist.
    Through the Python entry point's options, as the CLI builds them."""
    from rdma_kv.cli.info import load_settings

    config = {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
              "kv_role": "kv_consumer", "kv_connector_extra_config": {"ucx_net_devices": "lo,mlx5_9:1"}}
    settings = load_settings(json.dumps(config))
    seen = []
    checks = run_selftest(SelftestOptions(quick=True, settings=settings, deadline_s=float(DEADLINE)), seen.append)
    assert checks == seen
    by_name = {c.name: c for c in checks}
    lo, unknown = by_name["nic:lo"], by_name["nic:mlx5_9:1"]
    assert lo.status is Status.PASS, lo.detail
    assert lo.detail.startswith("loopback through lo (TLS=tcp)") and "bit-exact" in lo.detail
    assert "tcp/lo" in str(lo.figures.get("ucx_protocol", "tcp/lo"))  # when UCX printed its choice
    assert unknown.status is Status.FAIL
    assert "names 'mlx5_9:1', but UCX reports no such device" in unknown.detail
    assert by_name["host.read"].status is Status.PASS  # the failure did not stop the rest

    path = tmp_path / "kv.json"
    path.write_text(json.dumps(config))
    assert main(["selftest", "--quick", "--timeout", DEADLINE, "--config", str(path)]) == 1
    assert "FAIL  nic:mlx5_9:1" in capsys.readouterr().out


def test_a_bad_config_is_refused_before_anything_runs(capsys):
    assert main(["selftest", "--quick", "--config", '{"kv_connector": "RdmaKVConnector", "kv_role": "kv_consumer", '
                 '"kv_connector_extra_config": {"ucx_net_devices": 3}}', "--engine", "rdma-kv"]) == 2
    err = capsys.readouterr().err
    assert "ucx_net_devices must be a template string or a map" in err
