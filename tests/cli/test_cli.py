"""The rdma-kv command line: argument validation, ucx_info parsing and a
small real demo run (config findings: test_info_config.py)."""

from __future__ import annotations

import json

import pytest

from rdma_kv.cli import main
from rdma_kv.cli.bench import parse_kv_shape, perftest_sizes
from rdma_kv.cli.info import parse_ucx_info
from rdma_kv.errors import ConfigError

UCX_INFO = """\
# Memory domain: self
#         memory types: host (access,reg_nonblock,reg,cache)
#      Transport: self
#         Device: memory
#           Type: loopback
# Memory domain: mlx5_0
#         memory types: host (access,reg,cache), cuda (reg)
#      Transport: rc_mlx5
#         Device: mlx5_0:1
#           Type: network
#      Transport: ud_verbs
#         Device: mlx5_0:1
#           Type: network
"""


def test_parse_ucx_info_lists_transports_devices_and_memory_types():
    transports, mem = parse_ucx_info(UCX_INFO)
    assert [(t["transport"], t["device"], t["md"]) for t in transports] == [
        ("self", "memory", "self"), ("rc_mlx5", "mlx5_0:1", "mlx5_0"), ("ud_verbs", "mlx5_0:1", "mlx5_0")]
    assert mem == {"host", "cuda"}


def test_transports_are_grouped_by_the_memory_types_of_their_domain():
    """A domain that lists no memory type (tcp, cma) moves host memory
    through the CPU; mlx5 registers host and CUDA memory (GPUDirect)."""
    from rdma_kv.transport.ucxinfo import by_memory_type

    text = UCX_INFO + "# Memory domain: tcp\n#         memory types: \n#      Transport: tcp\n#         Device: lo\n"
    transports, _ = parse_ucx_info(text)
    assert [t["memory_types"] for t in transports] == ["host", "host,cuda", "host,cuda", ""]
    assert by_memory_type(transports) == {"host": ["self/memory", "rc_mlx5/mlx5_0:1", "ud_verbs/mlx5_0:1", "tcp/lo"],
                                          "cuda": ["rc_mlx5/mlx5_0:1", "ud_verbs/mlx5_0:1"]}


def test_kv_shape_parses_and_rejects_bad_input():
    w = parse_kv_shape("4:16:4096:contiguous")
    assert (w.num_layers, w.blocks_per_request, w.block_nbytes, w.block_order) == (4, 16, 4096, "contiguous")
    assert w.pool_blocks >= 2 * 16
    for bad in ("4:16", "a:16:4096", "4:16:4096:sideways"):
        with pytest.raises(ConfigError, match="--kv-shape"):
            parse_kv_shape(bad)


def test_perftest_sizes_take_units_and_none():
    assert perftest_sizes("32768,256MiB") == [32768, 256 << 20]
    assert perftest_sizes("") == perftest_sizes("none") == perftest_sizes(" None ") == []
    with pytest.raises(ConfigError, match="--perftest: 'lots' is not a size.*none for no ucx_perftest"):
        perftest_sizes("32KiB,lots")


def test_unknown_option_is_rejected_outside_demo(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_demo_help_lists_the_transport_mode(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    assert exited.value.code == 0 and "--transport" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),  # was a ZeroDivisionError traceback
    (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),  # was a 2.5 min wait, then "did not finish"
    (["--min-tokens", "100", "--max-tokens", "50"], "--min-tokens 100 exceeds --max-tokens 50"),  # numpy's low >= high
    # was the right ConfigError, inside two engine processes' tracebacks
    (["--extra-config", '{"lease_ttl": 5}'], "--extra-config: RdmaKVConnector: unknown kv_connector_extra_config key"),
    (["--extra-config", '{"rpc_retries": 100}'], "--extra-config: rpc_retries must be in"),
    # the secret is loaded by each worker, not by the settings parser (a review of the first version)
    (["--extra-config", '{"auth_secret_env": "RDMA_KV_TEST_NEVER_SET"}'], "--extra-config: "),
])
def test_demo_refuses_bad_arguments_before_it_starts_anything(capsys, argv, says):
    """Found by an adversarial review of the CLI: each ended in a traceback
    or a long wait; now a usage error (exit 2) that names the argument."""
    with pytest.raises(SystemExit) as exited:
        main(["demo", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "Traceback" not in err


def test_selftest_refuses_a_timeout_past_a_day(capsys):
    """A --timeout of 1e300 was reported as "FAIL host.read OverflowError"
    (exit 1), blaming the host for a bad argument."""
    code = main(["selftest", "--quick", "--timeout", "1e300"])
    assert code == 2 and "--timeout must be in (0, 86400] seconds" in capsys.readouterr().err


def test_bench_rejects_unknown_peer(capsys):
    assert main(["bench", "--vs", "mooncake", "--reps", "1"]) == 2
    assert "unknown; valid: nixl" in capsys.readouterr().err


@pytest.mark.ucx
def test_info_json_reports_the_loaded_ucx(capsys):
    assert main(["info", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shim"] == "loaded" and out["ucx_version"].startswith("1.")
    assert any(t["transport"] == "tcp" for t in out["transports"])


@pytest.mark.ucx
def test_info_tells_warnings_only_from_a_usage_error(capsys):
    """Found by a review of the CLI: ``info`` exited 2 both for "warnings
    only" and for a mistyped option (argparse's usage error, 2 for every
    command), so a script could not tell "deployable with warnings" from "the
    check never ran". Warnings only is now 3."""
    warned = json.dumps({"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
                         "kv_role": "kv_consumer", "kv_buffer_device": "cuda"})
    code = main(["info", "--config", warned])
    out = capsys.readouterr().out
    if "[warning] kv_buffer_device is cuda" not in out:
        pytest.skip("this host has CUDA: the config has no warning here")
    assert code == 3 and "[error]" not in out, out
    with pytest.raises(SystemExit) as exited:
        main(["info", "--confgi", warned])
    assert exited.value.code == 2 and "unrecognized arguments: --confgi" in capsys.readouterr().err


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_demo_moves_and_verifies_bytes(capsys):
    assert main(["demo", "--transport", "--reps", "1", "--layers", "2", "--blocks", "8", "--block-bytes", "4096"]) == 0
    out = capsys.readouterr().out
    assert "16 operations" in out or "32 descriptors" in out
    assert "demo passed" in out


def test_python_dash_m_rdma_kv_is_the_cli():
    """``python -m rdma_kv`` where the console script is not on PATH (a
    source tree on PYTHONPATH, as on the GPU node of deploy.md section 10)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rdma_kv", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("rdma-kv ")


@pytest.mark.parametrize("argv", [
    ["selftest", "--quick", "--json"],
    ["bench", "--workloads", "kv-one-block", "--reps", "1", "--no-cma", "--perftest", "none", "--json"],
    ["bench", "--scale", "concurrency", "--concurrency", "1", "--scale-backends", "rdma-kv", "--reps", "1", "--csv"],
])
def test_an_output_path_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, argv):
    """Found by a review of the CLI: ``selftest --json`` (and ``bench
    --json`` / ``--csv``) into a directory that does not exist, or one not
    writable, ran every check (minutes for a full selftest or bench), then
    ended in a FileNotFoundError traceback with exit status 1: the
    selftest's "a check FAILed", after a summary that said nothing failed.
    Now a usage error (exit 2) naming the flag and the path, before
    anything runs."""
    from rdma_kv import selftest
    from rdma_kv.bench import baselines, scale

    ran: list[str] = []
    monkeypatch.setattr(selftest, "run_selftest", lambda *a, **k: ran.append("selftest") or [])
    monkeypatch.setattr(baselines, "run", lambda *a, **k: ran.append("bench") or [])
    monkeypatch.setattr(scale, "run_axis", lambda *a, **k: ran.append("scale") or [])
    path = tmp_path / "no-such-dir" / "out.json"
    assert main([*argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{argv[-1]} {str(path)!r}: cannot write" in err and "Traceback" not in err, err
    assert ran == [] and not path.parent.exists()


@pytest.mark.parametrize("extra", ["[]", '""', "false", "0"])
def test_selftest_refuses_an_extra_config_that_is_not_an_object_as_info_does(capsys, monkeypatch, extra):
    """Found by a review of the CLI: ``kv_connector_extra_config: []`` (or
    ``""``, ``false``, ``0``) in an rdma-kv config was taken for ``{}`` by
    ``selftest --config``, which ran every check with the defaults and
    exited 0, while ``info --config`` rejected the same config (exit 1) and
    the engine refuses it at startup."""
    from rdma_kv import selftest

    ran: list[object] = []
    monkeypatch.setattr(selftest, "run_selftest", lambda *a, **k: ran.append(a) or [])
    config = '{"kv_connector": "RdmaKVConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": %s}' % extra
    assert main(["selftest", "--quick", "--config", config]) == 2
    assert "kv_connector_extra_config must be a JSON object" in capsys.readouterr().err and ran == []
