"""UCX's configuration files count: what ``rdma-kv info`` and the selftest
say UCX will use is read from UCX itself (``transport.ucx.ucx_config``),
so a ``ucx.conf`` that names the transports is seen. Before, both read
``os.environ`` alone and said "UCX_TLS unset: all" on a host whose
ucx.conf names ``tcp`` (and judged push over TCP from that).

UCX parses its configuration files once, when it is loaded: each case runs
in a fresh interpreter whose current directory holds the ucx.conf (one of
the places UCX reads one from)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx

PROBE = """
import json, sys
from rdma_kv.cli.info import Report, check_config
from rdma_kv.transport.ucx import Context, ucx_config, ucx_setting, ucx_setting_source
options = json.loads(sys.argv[1])
report = Report(cuda="no CUDA device (no GPU driver)")
config = {"kv_connector": "RdmaKVConnector", "kv_role": "kv_consumer", "kv_port": 0,
          "kv_connector_extra_config": {"mode": "push", "ucx_options": options}}
check_config(json.dumps(config), report)
context = Context(options)
context.close()
read = ucx_config(options)
print(json.dumps({
    "tls": ucx_setting(options, "TLS"), "source": ucx_setting_source(options, "TLS"),
    "rndv": read["RNDV_THRESH"], "rails": read["MAX_RMA_RAILS"],
    "push": [f.message for f in report.findings if f.message.startswith("mode push")],
}))
"""


def probe(cwd, options: dict[str, str] | None = None, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(options or {})], cwd=cwd, env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def conf_dir(tmp_path):
    (tmp_path / "ucx.conf").write_text("UCX_TLS=sm,self\nUCX_MAX_RMA_RAILS=1\n")
    return tmp_path


def test_a_ucx_conf_naming_the_transports_is_what_info_reports(conf_dir) -> None:
    seen = probe(conf_dir)
    assert seen["tls"] == "sm,self" and "ucx.conf" in seen["source"], seen
    # push judged on what UCX will use: no tcp there, so no warning
    assert len(seen["push"]) == 1 and seen["push"][0].startswith("mode push: tcp is not"), seen
    assert "ucx.conf" in seen["push"][0], seen


def test_the_environment_and_the_config_win_over_the_file(conf_dir) -> None:
    seen = probe(conf_dir, UCX_TLS="tcp")
    assert (seen["tls"], seen["source"]) == ("tcp", "UCX_TLS"), seen
    assert "tcp among UCX's transports" in seen["push"][0], seen
    seen = probe(conf_dir, {"TLS": "tcp,self"})
    assert (seen["tls"], seen["source"]) == ("tcp,self", "ucx_options['TLS']"), seen


def test_without_a_file_the_default_holds_and_rdma_kv_defaults_apply(tmp_path) -> None:
    seen = probe(tmp_path)
    assert seen["tls"] is None and seen["source"] == "UCX_TLS unset (UCX's default)", seen
    assert seen["push"] and "UCX_TLS unset: all" in seen["push"][0], seen
    # rdma-kv's defaults, as the agent's context gets them (transport.ucx.DEFAULT_OPTIONS)
    assert seen["rndv"].endswith("inf") and seen["rails"] == "2", seen


def test_rdma_kv_defaults_replace_a_file_value_unless_the_environment_sets_it(conf_dir) -> None:
    """Said in docs/deploy.md, section 2: UCX does not say which file set what,
    so a ucx.conf value of one of rdma-kv's defaults is replaced; the
    environment (or ucx_options) keeps it."""
    assert probe(conf_dir)["rails"] == "2"
    assert probe(conf_dir, UCX_MAX_RMA_RAILS="1")["rails"] == "1"
    assert probe(conf_dir, {"MAX_RMA_RAILS": "1"})["rails"] == "1"
