"""Push mode in real vLLM behind the project's router: vllm-router 0.1.17
(its default NIXL protocol: prefill first, its params to the decode, i.e.
sequential dispatch) over vLLM OpenAI servers whose kv-transfer-config
says ``"mode": "push"`` on both sides.

``test_push_1p1d_through_vllm_router_equal_plain``:

- sequential requests, 128 in flight at once, and streaming all equal the
  plain server's completions;
- every decode request received its KV by push
  (``rdma_kv_pushed_loads_total{outcome="ok"}``) and none failed: at 128 in
  flight no lease lapsed (the producer pins a lease while it writes, and
  the decode renews it while it waits);
- the producer counts its pushes (``rdma_kv_pushes_total{outcome="done"}``)
  and the bytes it wrote (``rdma_kv_push_written_bytes_total``); it read
  nothing back and holds no lease at the end;
- control: a producer with other weights, pushing into the same decode,
  changes the completions: the KV really came over the wire.

Run in the vLLM venv (scripts/install-vllm.sh installs vllm-router):

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_push.py -q
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from serve_proc import ApiServer, Router, complete, free_port, metric, wait_for  # noqa: E402
from test_vllm_router import (  # noqa: E402
    MAX_TOKENS,
    ROUTER_PROMPTS,
    START_S,
    check_equal,
    expected,
    prefill_params,
    rdma_config,
)
from tiny_model import build_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(900)]


def push_config(role: str) -> dict[str, Any]:
    return rdma_config(role, mode="push")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A plain server; a push prefill and decode, both also registered with
    a discovery address where the moriio-mode router of the second test
    listens (until then nobody does: ZMQ queues, nothing breaks); a push
    prefill with other weights (registered nowhere)."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    other_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-other"), seed=1)
    log_dir = tmp_path_factory.mktemp("push-logs")
    discovery = f"127.0.0.1:{free_port()}"
    p_port, d_port = free_port(), free_port()

    def registered(role: str, port: int) -> dict[str, Any]:
        return rdma_config(role, mode="push", router_discovery_address=discovery,
                           router_http_address=f"127.0.0.1:{port}")

    made = {"plain": ApiServer("plain", model_dir, log_dir),
            "prefill": ApiServer("prefill-push", model_dir, log_dir, port=p_port,
                                 kv_transfer_config=registered("kv_producer", p_port)),
            "other": ApiServer("prefill-push-other-weights", other_dir, log_dir,
                               kv_transfer_config=push_config("kv_producer")),
            "decode": ApiServer("decode-push", model_dir, log_dir, port=d_port,
                                kv_transfer_config=registered("kv_consumer", d_port))}
    try:
        for s in made.values():
            s.wait_healthy(START_S)
        yield {**made, "log_dir": log_dir, "discovery": discovery}
    finally:
        for s in made.values():
            s.close()


def test_push_1p1d_through_vllm_router_equal_plain(servers: dict[str, Any]) -> None:
    plain, p, other, d = servers["plain"], servers["prefill"], servers["other"], servers["decode"]
    reference: dict[tuple[str, int], str] = {}
    many = [ROUTER_PROMPTS[i % len(ROUTER_PROMPTS)] for i in range(128)]
    with Router("router-push", servers["log_dir"], prefill=[p.url], decode=[d.url]) as router:
        router.wait_healthy(120)
        sent = check_equal(router, plain, reference, ROUTER_PROMPTS)
        sent += check_equal(router, plain, reference, many, in_flight=128)
        sent += check_equal(router, plain, reference, ROUTER_PROMPTS, stream=True)
    assert metric(d.url, "rdma_kv_pushed_loads_total", outcome="ok") == sent, d.log()[-3000:]
    assert metric(d.url, "rdma_kv_loads_total", outcome="ok") == sent
    assert metric(d.url, "rdma_kv_loads_total", outcome="failed") == 0
    assert "KV load failed" not in d.log()
    assert metric(p.url, "rdma_kv_pushes_total", outcome="done") == sent, p.log()[-3000:]
    assert metric(p.url, "rdma_kv_push_written_bytes_total") > 0
    wait_for("the producer to release every lease", lambda: metric(p.url, "rdma_kv_leases_held") == 0, 30)

    # Control: the same decode, KV pushed by a producer with other weights.
    differ = []
    for prompt in ROUTER_PROMPTS[1:]:  # the 7-token prompt fits in one block: its output may coincide
        params = prefill_params(other, prompt)
        out = complete(d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        assert out["status"] == 200, out
        differ.append(out["text"] != expected(plain, reference, prompt))
    assert all(differ), f"a producer with other weights left completions unchanged: {differ}"
    assert metric(d.url, "rdma_kv_loads_total", outcome="failed") == 0


def test_concurrent_dispatch_through_vllm_router_moriio_write_mode(servers: dict[str, Any]) -> None:
    """vllm-router 0.1.17 ``--kv-connector moriio`` with both engines
    registered as WRITE (``router_discovery_address``): the router sends the
    prefill and the decode legs at once, giving both the same
    ``transfer_id`` and the prefill's side channel in ``X-Request-Id``. The
    decode registers its blocks under the transfer id, most of them before
    their prefill finished; the producer writes each prompt once its prefill
    did. Every completion equals plain; none was recomputed."""
    plain, p, d = servers["plain"], servers["prefill"], servers["decode"]
    reference: dict[tuple[str, int], str] = {}
    before = {"loads": metric(d.url, "rdma_kv_pushed_loads_total", outcome="ok"),
              "pushes": metric(p.url, "rdma_kv_pushes_total", outcome="done"),
              "early": metric(p.url, "rdma_kv_events_total", event="push_registrations_early"),
              "regs": metric(p.url, "rdma_kv_events_total", event="push_registrations")}
    many = [ROUTER_PROMPTS[i % len(ROUTER_PROMPTS)] for i in range(32)]
    with Router("router-moriio", servers["log_dir"], prefill=[], decode=[],
                extra_args=["--kv-connector", "moriio", "--vllm-discovery-address", servers["discovery"]]) as router:
        router.wait_healthy(120)
        sent = check_equal(router, plain, reference, ROUTER_PROMPTS)
        sent += check_equal(router, plain, reference, many, in_flight=16)
        sent += check_equal(router, plain, reference, ROUTER_PROMPTS, stream=True)
    assert metric(d.url, "rdma_kv_pushed_loads_total", outcome="ok") - before["loads"] == sent, d.log()[-3000:]
    assert metric(d.url, "rdma_kv_loads_total", outcome="failed") == 0
    assert "KV load failed" not in d.log()
    assert metric(p.url, "rdma_kv_pushes_total", outcome="done") - before["pushes"] == sent
    registrations = metric(p.url, "rdma_kv_events_total", event="push_registrations") - before["regs"]
    early = metric(p.url, "rdma_kv_events_total", event="push_registrations_early") - before["early"]
    assert registrations == sent, (registrations, sent)
    # Concurrent, not sequential: decodes registered while their prefill was still running.
    assert early > 0, f"no decode registered before its prefill finished ({registrations} registrations)"
    # How many layers went out during the prefill's forward pass depends on when each registration
    # arrived (before the pass, during it, or after it): reported, not asserted.
    layer_writes = metric(p.url, "rdma_kv_events_total", event="push_layer_writes")
    overlapped = metric(p.url, "rdma_kv_push_overlapped_bytes_total")
    written = metric(p.url, "rdma_kv_push_written_bytes_total")
    assert 0 <= overlapped <= written
    print(f"moriio WRITE: {sent} requests, {int(early)} registered before their prefill finished, "
          f"{int(layer_writes)} layer write batches, {overlapped / max(written, 1):.0%} of the bytes written "
          "during the prefill's forward pass")


def test_layers_go_out_during_the_prefills_forward_pass_in_vllm(servers: dict[str, Any]) -> None:
    """The decode leg first, the prefill leg once the producer holds its
    registration, both as vllm-router's moriio mode sends them (its
    ``X-Request-ID`` and ``kv_transfer_params``): the prefill's layers are
    written as vLLM stores them (``save_kv_layer``), not after the forward
    pass. vLLM 0.32 calls ``start_load_kv`` after the forward pass when the
    step's loads are asynchronous; the layer-wise writes set up there never
    overlapped anything (0 bytes during the pass). The completion equals
    plain."""
    import re
    import threading
    import uuid

    plain, p, d = servers["plain"], servers["prefill"], servers["decode"]
    found = re.search(r"registering with the router at \S+ as P \(WRITE\), side channel (\S+)", p.log())
    assert found, p.log()[-3000:]
    prompt = ROUTER_PROMPTS[-1] * 3  # several whole blocks (block 32)
    want = expected(plain, {}, prompt)
    header = f"___prefill_addr_{found.group(1)}___decode_addr_host:127.0.0.1,handshake:0,engine:decode,tp:1_{uuid.uuid4().hex}"
    tid = f"tx-{uuid.uuid4().hex}"
    before = {name: metric(p.url, f"rdma_kv_{name}") for name in ("push_overlapped_bytes_total",
                                                                  "push_written_bytes_total")}
    waiting = metric(d.url, "rdma_kv_events_total", event="push_loads_waiting")
    out: dict[str, Any] = {}
    decode_leg = threading.Thread(target=lambda: out.update(complete(
        d.url, prompt, max_tokens=MAX_TOKENS, headers={"X-Request-ID": header},
        kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": None,
                            "remote_block_ids": None, "transfer_id": tid})))
    decode_leg.start()
    # The decode's metrics move while its request waits (it steps); an idle producer's do not.
    wait_for("the decode's registration at the producer (answered WAITING)",
             lambda: metric(d.url, "rdma_kv_events_total", event="push_loads_waiting") > waiting, 120)
    prefill = complete(p.url, prompt, max_tokens=1, headers={"X-Request-ID": header},
                       kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_tp_size": 1, "transfer_id": tid})
    decode_leg.join(180)
    assert prefill["status"] == 200, prefill
    assert out.get("status") == 200 and out["text"] == want, (out, want)
    written = metric(p.url, "rdma_kv_push_written_bytes_total") - before["push_written_bytes_total"]
    overlapped = metric(p.url, "rdma_kv_push_overlapped_bytes_total") - before["push_overlapped_bytes_total"]
    assert 0 < overlapped <= written, (overlapped, written, p.log()[-3000:])
    print(f"decode registered first: {overlapped / written:.0%} of {int(written)} bytes written during the "
          "prefill's forward pass")
