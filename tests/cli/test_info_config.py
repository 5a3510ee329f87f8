"""``rdma-kv info --config``: one row per case, input -> findings -> exit code.

The check runs the connector's own parsers (vLLM's fields and the adapter's
translation for a vLLM config, then ``RdmaSettings.from_config``), so each
row is also what the engine would do with that config at startup.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_kv.cli import info
from rdma_kv.cli.info import Report, check_config, exit_code

VLLM = {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm"}
OURS = {"kv_connector": "RdmaKVConnector"}
NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this host


def vllm(role: str = "kv_producer", extra: dict[str, Any] | None = None, **fields: Any) -> str:
    # port 0 unless a row sets one: the rows must not depend on 14579 being free here
    config = {**VLLM, "kv_role": role, "kv_port": 0, **fields}
    if extra is not None:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


def findings(text: str, **kwargs: Any) -> tuple[Report, int]:
    report = Report(cuda="no CUDA device (no GPU driver)")
    check_config(text, report, **kwargs)
    return report, exit_code(report)


def show(report: Report) -> str:
    return "\n".join(f"[{f.level}] {f.message}" for f in report.findings)


# (case, config text, (level, substring) expected among the findings, exit code)
TABLE: list[tuple[str, str, list[tuple[str, str]], int]] = [
    ("vLLM producer, defaults", vllm(),
     [("ok", "vLLM RdmaKVConnector config"), ("ok", "127.0.0.1 is an address of this host"),
      ("ok", "the OS picks a free port")], 0),
    ("vLLM consumer", vllm("kv_consumer"), [("ok", "opens no side-channel listener")], 0),
    ("misspelt extra key", vllm(extra={"side_channel_hots": "10.0.0.1"}),
     [("error", "unknown kv_connector_extra_config key(s) ['side_channel_hots']")], 1),
    ("lease_ttl_s out of range", vllm(extra={"lease_ttl_s": -1}),
     [("error", "lease_ttl_s must be in [1, 86400] seconds, got -1")], 1),
    ("lanes out of range", vllm(extra={"lanes": 0}), [("error", "lanes must be 1..16, got 0")], 1),
    ("lanes of the wrong type", vllm(extra={"lanes": "2"}), [("error", "lanes")], 1),
    ("kv_ip under vLLM 0.32", vllm(kv_ip="10.0.0.1"),
     [("error", "has no field(s) ['kv_ip']"), ("error", "kv_connector_extra_config['side_channel_host']")], 1),
    ("tp_size set by the user", vllm(extra={"tp_size": 2}),
     [("error", "come from vLLM's config")], 1),
    ("host not on this host", vllm(extra={"side_channel_host": NOT_HERE, "allow_unauthenticated": True}),
     [("error", f"side_channel_host {NOT_HERE} is not an address of this host")], 1),
    ("host not on this host, consumer", vllm("kv_consumer", extra={"side_channel_host": NOT_HERE}),
     [("ok", "opens no side-channel listener")], 0),
    ("0.0.0.0 without a secret", vllm(extra={"side_channel_host": "0.0.0.0", "advertise_host": "10.0.0.1"}),
     [("error", "no shared secret is configured")], 1),
    ("0.0.0.0, unauthenticated allowed", vllm(extra={"side_channel_host": "0.0.0.0", "advertise_host": "10.0.0.1",
                                                    "allow_unauthenticated": True}),
     [("warning", "listens on every interface without a shared secret")], 3),
    ("0.0.0.0 with a secret", vllm(extra={"side_channel_host": "0.0.0.0", "advertise_host": "10.0.0.1",
                                         "auth_secret_env": "RDMA_KV_SECRET"}),
     [("ok", "the OS picks a free port")], 0),
    ("vLLM, kv_buffer_device unset (the platform's)", vllm(), [("ok", "")], 0),
    ("vLLM, kv_buffer_device cpu", vllm(kv_buffer_device="cpu"), [("ok", "")], 0),
    ("vLLM, kv_buffer_device cuda without CUDA", vllm(kv_buffer_device="cuda"),
     [("warning", "kv_buffer_device is cuda but no CUDA device")], 3),
    ("bad role", vllm("kv_wrong"), [("error", "kv_wrong")], 1),
    ("extra config not an object", vllm(extra=["lanes", 2]),  # type: ignore[arg-type]
     [("error", "kv_connector_extra_config must be a JSON object, got list")], 1),
    ("kv_port of the wrong type", vllm(kv_port="14579"), [("error", "kv_port must be an integer")], 1),
    ("not JSON", "{not json", [("error", "config is not valid JSON")], 1),
    ("rdma-kv's own config, kv_ip 0.0.0.0", json.dumps({**OURS, "kv_role": "kv_both", "kv_ip": "0.0.0.0",
                                                         "kv_port": 0, "kv_buffer_device": "cpu",
                                                         "kv_connector_extra_config": {
                                                             "advertise_host": "10.0.0.1",
                                                             "allow_unauthenticated": True}}),
     [("ok", "rdma-kv RdmaKVConnector config"), ("warning", "0.0.0.0 listens on every interface")], 3),
    ("rdma-kv's own config, another connector", json.dumps({"kv_connector": "StorageConnector",
                                                           "kv_role": "kv_both"}),
     [("ok", "settings are not checked")], 0),
]


@pytest.mark.parametrize("case, text, expected, code", TABLE, ids=[row[0] for row in TABLE])
def test_info_config_table(case: str, text: str, expected: list[tuple[str, str]], code: int) -> None:
    report, got = findings(text)
    for level, substring in expected:
        assert any(f.level == level and substring in f.message for f in report.findings), show(report)
    assert got == code, show(report)
    if code == 0:
        assert all(f.level == "ok" for f in report.findings), show(report)


def test_a_missing_file_is_reported_as_missing(tmp_path) -> None:
    report, code = findings(str(tmp_path / "kv.json"))
    assert code == 1 and "not found" in show(report) and "JSON" in show(report)


def test_json_text_that_is_not_an_object_is_said_to_be_so() -> None:
    """Found by a review of the CLI: ``--config '[1, 2]'`` was taken for a
    file name ("config file '[1, 2]' not found")."""
    report, code = findings("[1, 2]")
    assert code == 1 and "config must be a JSON object, got list" in show(report), show(report)


def test_a_file_is_read(tmp_path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(vllm(extra={"lanes": 0}))
    report, code = findings(str(path))
    assert code == 1 and "lanes must be 1..16" in show(report)
    path.write_text("[1, 2]")
    report, code = findings(str(path))
    assert code == 1 and "must be a JSON object, got list" in show(report)


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_a_port_in_use_is_an_error_for_a_producer_only(listening_port: int) -> None:
    report, code = findings(vllm(kv_port=listening_port))
    assert code == 1 and f"port {listening_port} on 127.0.0.1 is in use" in show(report)
    assert "kv_port or side_channel_port" in show(report) and "kv_ip" not in show(report)
    report, code = findings(vllm(extra={"side_channel_port": listening_port}))
    assert code == 1 and "in use" in show(report)
    report, code = findings(vllm("kv_consumer", kv_port=listening_port))
    assert code == 0, show(report)


def test_a_time_wait_port_is_free_for_the_producer() -> None:
    # The producer's listener sets SO_REUSEADDR (so do its accepted
    # connections); the server closing first leaves its side in TIME-WAIT.
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = listener.accept()
        conn.close()
        assert client.recv(1) == b""  # the server's FIN arrived
        client.close()
    with socket.socket() as plain, pytest.raises(OSError) as caught:
        plain.bind(("127.0.0.1", port))  # the connection is still there (TIME-WAIT)
    assert caught.value.errno == errno.EADDRINUSE
    report, code = findings(vllm(kv_port=port))
    assert code == 0 and f"127.0.0.1:{port} is free" in show(report), show(report)


def test_another_vllm_version_is_warned_about(monkeypatch) -> None:
    monkeypatch.setattr(info, "_vllm_version", lambda: "0.33.1")
    report, code = findings(vllm())
    assert code == 3 and "vLLM 0.33.1 is installed" in show(report)


def test_engine_option_forces_the_vllm_rules() -> None:
    text = json.dumps({**OURS, "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 0})
    assert findings(text)[1] == 3  # rdma-kv's own: kv_ip is a field (cuda default warns)
    report, code = findings(text, engine="vllm")
    assert code == 1 and "has no field(s) ['kv_ip']" in show(report)


@pytest.mark.ucx
def test_exit_codes_of_the_command(tmp_path, capsys) -> None:
    from rdma_kv.cli import main

    assert main(["info", "--config", vllm()]) == 0
    assert main(["info", "--config", vllm(kv_buffer_device="cuda")]) == 3
    assert main(["info", "--config", str(tmp_path / "missing.json")]) == 1
    assert "[error] config file" in capsys.readouterr().out


# What `ucx_info -d` reported on this kind of host, and an InfiniBand port.
DEVICES = [{"md": "self", "transport": "self", "device": "memory", "type": "loopback", "memory_types": "host"},
           {"md": "tcp", "transport": "tcp", "device": "lo", "type": "network", "memory_types": ""},
           {"md": "mlx5_0", "transport": "rc_mlx5", "device": "mlx5_0:1", "type": "network", "memory_types": "host"}]


@pytest.mark.parametrize("text", [
    # a port of its own: port 0 (OS-chosen) is for one rank only
    vllm("kv_consumer", extra={"ucx_net_devices": {"0": "mlx5_0:1", "1": "lo"}}, kv_port=14579),
    json.dumps({**OURS, "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"ucx_net_devices": {"0": "mlx5_0:1", "1": "lo"}}}),
], ids=["vllm", "rdma-kv"])
def test_a_device_map_of_every_rank_is_accepted_and_each_device_found(text: str) -> None:
    """Found by a review of the CLI: ``info --config`` checked a config as
    tensor-parallel size 1, so a ``ucx_net_devices`` map of a TP-2 engine's
    two ranks, which the engine accepts, was an error ("names ranks [0, 1];
    name every rank 0..0")."""
    report = Report(cuda="no CUDA device (no GPU driver)", transports=DEVICES)
    check_config(text, report)
    assert exit_code(report) == 0, show(report)
    assert any(f.level == "ok" and "rank 0: mlx5_0:1; ucx_net_devices of rank 1: lo" in f.message
               for f in report.findings), show(report)


@pytest.mark.parametrize("extra, where", [
    ({"ucx_net_devices": "mlx5_{rank}:1,mlx5_9:1"}, "ucx_net_devices of rank 0 names 'mlx5_9:1'"),
    ({"ucx_net_devices": {"0": "mlx5_0:1", "1": "mlx5_1:1"}}, "ucx_net_devices of rank 1 names 'mlx5_1:1'"),
    ({"ucx_options": {"NET_DEVICES": "mlx5_0:2"}}, "ucx_options['NET_DEVICES'] names 'mlx5_0:2'"),
])
def test_a_nic_the_loaded_ucx_does_not_report_is_an_error(extra: dict[str, Any], where: str) -> None:
    """Found by a review of the CLI: a misspelt or absent NIC (``mlx5_99:1``)
    was "ok": an engine so configured starts, and its reads fail only when
    they run ("Destination is unreachable"). ``info`` has the device list
    of ``ucx_info -d``; the selftest already FAILed such a device."""
    report = Report(cuda="no CUDA device (no GPU driver)", transports=DEVICES)
    check_config(vllm("kv_consumer", extra=extra, kv_port=14579), report)
    assert exit_code(report) == 1, show(report)
    (error,) = [f for f in report.findings if f.level == "error"]
    assert where in error.message and "network devices: lo, mlx5_0:1" in error.message, error.message


@pytest.mark.parametrize("devices", ["mlx5_0", "^mlx5_0:1", "mlx5_[0-1]:1", "all", "lo,mlx5_0"])
def test_nic_names_ucx_accepts_are_not_errors(devices: str) -> None:
    """UCX matches an HCA named without its port (``mlx5_0`` for
    ``mlx5_0:1``), reads ``^`` as "all but these" and expands ranges: such
    a config worked in the engine, and info called it an error."""
    report = Report(cuda="no CUDA device (no GPU driver)", transports=DEVICES)
    check_config(vllm("kv_consumer", extra={"ucx_options": {"NET_DEVICES": devices}}, kv_port=14579), report)
    assert exit_code(report) == 0, show(report)
    assert any(f.level == "ok" and f"ucx_options['NET_DEVICES']: {devices}" in f.message
               for f in report.findings), show(report)


@pytest.mark.parametrize("devices, named", [("^mlx5_9:1", "'mlx5_9:1'"), ("lo, mlx5_0:1", "' mlx5_0:1'"),
                                            ("mlx5", "'mlx5'"), ("mlx5_[1-3]:1", "'mlx5_[1-3]:1'")])
def test_nic_names_ucx_does_not_match_are_errors(devices: str, named: str) -> None:
    """An excluded name that is no device excludes nothing; UCX strips no
    spaces; a base name matches only up to the port's colon; a range that
    spans no device of this host (mlx5_1:1..mlx5_3:1) is named as written."""
    report = Report(cuda="no CUDA device (no GPU driver)", transports=DEVICES)
    check_config(vllm("kv_consumer", extra={"ucx_options": {"NET_DEVICES": devices}}, kv_port=14579), report)
    assert exit_code(report) == 1, show(report)
    (error,) = [f for f in report.findings if f.level == "error"]
    assert f"names {named}" in error.message, error.message


def test_all_among_other_devices_is_an_error() -> None:
    """UCX refuses ``all,lo`` (Invalid parameter): no engine so configured starts."""
    report = Report(cuda="no CUDA device (no GPU driver)", transports=DEVICES)
    check_config(vllm("kv_consumer", extra={"ucx_options": {"NET_DEVICES": "all,lo"}}, kv_port=14579), report)
    assert exit_code(report) == 1, show(report)
    (error,) = [f for f in report.findings if f.level == "error"]
    assert "ucx_options['NET_DEVICES']: 'all,lo': 'all' must stand alone" in error.message, error.message


def test_nics_are_not_judged_without_a_device_list() -> None:
    """No ``ucx_info`` (``probe`` warns of it): nothing to compare with."""
    report, code = findings(vllm("kv_consumer", extra={"ucx_net_devices": "mlx5_{rank}:1"}))
    assert code == 0 and "NIC" not in show(report), show(report)


@pytest.mark.parametrize("tls, warned", [
    (None, True),                    # UCX's default: all
    ("all", True),
    ("rc,tcp,self", True),
    ("^cma", True),                  # excludes something else
    ("^tcp:aux", True),              # tcp stays a transport for data
    ("^cma, tcp", True),             # UCX strips no spaces: " tcp" is no name, tcp stays
    ("rc,sm,self", False),
    ("^tcp", False),
    ("tcp:aux", False),              # wire-up only
    ("rc, tcp", False),              # " tcp" again: no tcp
    ("rc,all", False),               # all is a keyword only alone
    ("", False),                     # nothing allowed
])
def test_push_with_tcp_among_the_transports_is_warned_about(monkeypatch, tls: str | None, warned: bool) -> None:
    """Push over TCP can abort the decode inside UCX 1.22 (docs/deploy.md,
    "Push over TCP"): said wherever UCX may pick tcp, from the environment
    or from the config's own ucx_options, and only in push mode."""
    for source in ("env", "config"):
        monkeypatch.delenv("UCX_TLS", raising=False)
        extra: dict[str, Any] = {"mode": "push"}
        if tls is not None and source == "env":
            monkeypatch.setenv("UCX_TLS", tls)
        elif tls is not None:
            monkeypatch.setenv("UCX_TLS", "rc,sm,self")  # the config's own TLS wins
            extra["ucx_options"] = {"TLS": tls}
        report, code = findings(vllm("kv_consumer", extra=extra))
        push = [f for f in report.findings if f.message.startswith("mode push")]
        assert len(push) == 1, show(report)
        assert push[0].level == ("warning" if warned else "ok"), (source, show(report))
        assert code == (3 if warned else 0), show(report)
    # The config's own TLS wins over the environment's, both ways.
    monkeypatch.setenv("UCX_TLS", "tcp")
    report, code = findings(vllm("kv_consumer", extra={"mode": "push", "ucx_options": {"TLS": "rc,sm,self"}}))
    assert code == 0 and any(f.message.startswith("mode push: tcp is not") for f in report.findings), show(report)
    monkeypatch.setenv("UCX_TLS", "all")
    report, code = findings(vllm("kv_consumer", extra={"mode": "pull"}))
    assert not any(f.message.startswith("mode push") for f in report.findings) and code == 0, show(report)


@pytest.mark.parametrize("extra, env, warned", [
    ({}, None, True),                                              # NET_DEVICES unset: all, lo among them
    ({"ucx_options": {"NET_DEVICES": "mlx5_0:1"}}, None, False),   # an HCA port only: tcp has no device
    ({"ucx_options": {"NET_DEVICES": "mlx5_0"}}, None, False),     # the HCA by its base name
    ({"ucx_options": {"NET_DEVICES": "lo"}}, None, True),
    ({"ucx_options": {"NET_DEVICES": "mlx5_0:1,lo"}}, None, True),
    ({"ucx_options": {"NET_DEVICES": "^mlx5_0:1"}}, None, True),  # excludes the HCA: lo stays
    ({"ucx_options": {"NET_DEVICES": "^lo"}}, None, False),
    ({"ucx_options": {"NET_DEVICES": "all"}}, None, True),
    ({"ucx_options": {"NET_DEVICES": "mlx5_[0-1]:1"}}, None, False),  # a range of HCA ports: tcp has none
    ({}, "mlx5_0:1", False),                                       # UCX_NET_DEVICES
    ({"ucx_options": {"NET_DEVICES": "lo"}}, "mlx5_0:1", True),   # the config's own wins
    ({"ucx_options": {"NET_DEVICES": "mlx5_0:1"}}, "lo", False),
    ({"ucx_net_devices": "mlx5_{rank}:1"}, "lo", False),          # each rank's, over the environment's
    ({"ucx_net_devices": {"0": "mlx5_0:1", "1": "lo"}}, None, True),  # rank 1 has lo
])
def test_push_is_not_warned_about_where_net_devices_leave_tcp_no_device(
        monkeypatch, extra: dict[str, Any], env: str | None, warned: bool) -> None:
    """With ``ucx_info``'s device list, tcp among the transports counts only
    where NET_DEVICES leaves it a device of this host, read as UCX reads it
    (exact name or an HCA's base name; ``^`` excludes): an InfiniBand
    cluster's config that names only HCA ports sends no write over TCP, and
    a warning there would be a false alarm."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    if env is not None:
        monkeypatch.setenv("UCX_NET_DEVICES", env)
    report = Report(cuda="no CUDA device (no GPU driver)", transports=DEVICES)
    check_config(vllm("kv_consumer", extra={"mode": "push", **extra}, kv_port=14579), report)
    push = [f for f in report.findings if f.message.startswith("mode push")]
    assert len(push) == 1, show(report)
    assert push[0].level == ("warning" if warned else "ok"), show(report)
    assert exit_code(report) == (3 if warned else 0), show(report)
    assert "this host's TCP devices: lo" in push[0].message if not warned else "leaves it lo" in push[0].message, \
        show(report)
