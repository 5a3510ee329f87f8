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

``test_concurrent_dispatch_through_vllm_router_moriio_write_mode``: both
legs at once (vllm-router's moriio mode): every completion equals plain.

The failure paths use concurrent dispatch's registration (what the moriio
router sends, written here by hand: ``transfer_id`` and the prefill's side
channel in ``X-Request-Id``, no prefill leg yet), because it holds a
decode's push registered on the producer, nothing written, for as long as
the test needs (up to the producer's ``load_timeout_s``): a state a test can
observe, then break, deterministically.

- ``test_push_producer_killed_after_the_decode_registered_recomputes``;
- ``test_push_decode_aborted_while_registered_producer_writes_nothing``.

Run in the vLLM venv (scripts/install-vllm.sh installs vllm-router):

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_push.py -q
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from serve_proc import SERVED_MODEL, ApiServer, Router, complete, free_port, metric, wait_for  # noqa: E402
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


STARVATION_BOUNDS = {"load_timeout_s": 300.0, "lease_ttl_s": 120.0, "read_timeout_s": 60.0}
"""Five vLLM servers share this 2-core host, each spinning between steps;
with one busy loop beside them (2026-11-27), a producer's 32 KiB layer
write missed its deadline (``read_timeout_s``, 10 s by default) in 2 runs
of 2 of this module (the tree before that day's changes failed the module
under the same load too, on a producer count that did not grow in time;
docs/reliability.md, "Processes without a CPU"). The loads failed loudly
and recomputed, and the exact counts these tests assert did not add up.
One such write also expired at 60 s on a quiet machine, not diagnosed
(docs/reliability.md). These tests check that pushed KV is used and
equals plain, not how fast: the bounds leave room for a starved process,
and every wait still ends within them (test_vllm_push_hetero_tp.py does
the same). A killed producer is still met by its refused connection, not
by a bound.

``load_timeout_s`` was 120 s. A decode's load counts from the step that
starts it, and its PUSH (or PUSH_REG) is one side-channel round trip on
the decode's RPC thread, the calls to a producer rank one at a time: 128
in flight through one producer is a queue of up to ~100 PUSHes (the
decode's KV cache admits that many loads at once). Measured with each
push traced (2026-11-30, two busy loops and another vLLM module beside):
all of a load's time was that queue (the producer's answer and its
notification came within 0.1 s of the PUSH being sent, 183 of 184 by
notification, none lost), about 47 ms a round trip, and a thread asleep
in ``select`` woke up to 8-12 s late (idle servers' side-channel loops;
the decode's RPC thread once sat 8 s with 5 calls queued). A fresh-clone
CI run beside one busy loop had a median load of 55.5 s (about 0.9 s a
round trip), so the last of the queue passed 120 s: 1 of 128 loads
failed here and 3 of 32 in the moriio test (whose WAITING registrations
were each queried every second, ahead of the new registrations, until
``Pushes.poll`` kept one query per producer rank). 300 s is well above
that queue at CI's round trip, and below ``CLIENT_TIMEOUT_S``."""


CLIENT_TIMEOUT_S = 480.0
"""A push-mode request's bound at this test's HTTP client (through the
router, or to the decode with a prefill's params): above
every bound the decode has of its own for a push-mode load, so that a load
that stalls ends at the decode, loudly (its "KV load failed" line with the
reason, the recompute, the counts these tests assert), not at the client
first. The decode fails a load ``load_timeout_s`` (300 s here) after it
started, once its push resolved: with the producer answering, within the
writes' timeout after its RUNNING answer; with the producer not answering,
``lease_max_s`` + ``read_timeout_s`` (300 + 60 s) after the PUSH
(docs/rdma-connector.md, "Push mode"); the prefill leg comes before. The
client's bound used to be ``complete``'s 120 s, no more than the load's
own: in one fresh-clone CI run (2026-11-29, with another vLLM module
beside it) the first request through vllm-router timed out at the client
with nothing in vLLM's logs, because the client gave up first, the router
dropped the decode leg, vLLM aborted the request, and an aborted load is
not a failure (loads.py: no "KV load failed" line); what held it was never
seen. Bounded still: the test's own timeout (900 s) is above this one."""


def routed(router: Router, plain: ApiServer, reference: dict[tuple[str, int], str], prompts: list[str],
           p: ApiServer, d: ApiServer, **kwargs: Any) -> int:
    """``check_equal`` through ``router`` with ``CLIENT_TIMEOUT_S``; a
    failure carries the decode's and the producer's log tails."""
    try:
        return check_equal(router, plain, reference, prompts, timeout_s=CLIENT_TIMEOUT_S, **kwargs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- {d.name} log tail:\n{d.log()[-3000:]}\n--- {p.name} log tail:\n"
                             f"{p.log()[-3000:]}") from None


def push_config(role: str) -> dict[str, Any]:
    return rdma_config(role, mode="push", **STARVATION_BOUNDS)


def counts(p: ApiServer | None, d: ApiServer, since: dict[str, float] | None = None) -> dict[str, float]:
    """The decode's counters and the producer's (``p`` None: the decode's
    only), minus ``since``'s: so that each test checks what it did,
    whatever ran before it."""
    now = {"pushed_ok": metric(d.url, "rdma_kv_pushed_loads_total", outcome="ok"),
           "pushed_failed": metric(d.url, "rdma_kv_pushed_loads_total", outcome="failed"),
           "pushed_aborted": metric(d.url, "rdma_kv_pushed_loads_total", outcome="aborted"),
           "loads_ok": metric(d.url, "rdma_kv_loads_total", outcome="ok"),
           "loads_failed": metric(d.url, "rdma_kv_loads_total", outcome="failed"),
           "load_failed_lines": float(d.log().count("KV load failed")),
           "producer_gone": metric(d.url, "rdma_kv_events_total", event="push_producer_gone"),
           "loads_aborted": metric(d.url, "rdma_kv_events_total", event="loads_aborted")}
    if p is not None:
        now.update(done=metric(p.url, "rdma_kv_pushes_total", outcome="done"),
                   aborted=metric(p.url, "rdma_kv_pushes_total", outcome="aborted"),
                   failed=metric(p.url, "rdma_kv_pushes_total", outcome="failed"),
                   refused=metric(p.url, "rdma_kv_pushes_total", outcome="refused"),
                   written=metric(p.url, "rdma_kv_push_written_bytes_total"),
                   registrations=metric(p.url, "rdma_kv_events_total", event="push_registrations"))
    return now if since is None else {k: v - since.get(k, 0.0) for k, v in now.items()}


def router_request_id(params: dict[str, Any]) -> str:
    """What vllm-router's moriio mode puts in ``X-Request-Id``: the prefill's
    registered address (``params.format_router_address``: its rank 0 side
    channel, engine id, TP size), here taken from a prefill's params."""
    prefill = (f"host:{params['remote_host']},handshake:{params['remote_port']},"
               f"engine:{params['remote_engine_id']},tp:{params['tp_size']}")
    return f"___prefill_addr_{prefill}___decode_addr_host:127.0.0.1,handshake:1,engine:test,tp:1_{uuid.uuid4().hex}"


def concurrent_params(transfer_id: str, *, decode: bool) -> dict[str, Any]:
    """A leg's kv_transfer_params under concurrent dispatch (as the router sends them)."""
    return {"do_remote_prefill": decode, "do_remote_decode": not decode, "transfer_id": transfer_id,
            "remote_engine_id": None, "remote_block_ids": None, "remote_dp_size": 1, "remote_tp_size": 1}


class Leg:
    """One ``/v1/completions`` request sent on its own connection, its answer
    read on a thread (``result``), or the connection closed by the client
    before the answer (``hang_up``: vLLM aborts the request)."""

    def __init__(self, server: ApiServer, prompt: str, request_id: str, params: dict[str, Any], *,
                 max_tokens: int = MAX_TOKENS, stream: bool = False) -> None:
        self.stream = stream
        self.conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": stream, "kv_transfer_params": params}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body),
                          headers={"content-type": "application/json", "X-Request-Id": request_id})
        self.answer: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        if not stream:
            self._thread.start()

    def _read(self) -> None:
        try:
            r = self.conn.getresponse()
            raw = r.read().decode()
            self.answer = {"status": r.status, "text": json.loads(raw)["choices"][0]["text"]
                           if r.status == 200 else None, "raw": raw[:2000]}
        except Exception as exc:  # reported by result()
            self.answer = {"status": 0, "text": None, "raw": f"{type(exc).__name__}: {exc}"}

    def result(self, timeout_s: float) -> dict[str, Any]:
        self._thread.join(timeout_s)
        assert self.answer is not None, f"no answer within {timeout_s:.0f} s"
        return self.answer

    def hang_up(self) -> None:
        self.conn.close()


def step_reports(server: ApiServer) -> None:
    """One plain 1-token request: the engine steps, and its connector's
    counters and gauges reach ``/metrics`` (an idle engine reports nothing)."""
    out = complete(server.url, "hello world", max_tokens=1)
    assert out["status"] == 200, (out["status"], out["error"], server.log()[-6000:])


def wait_registered(producer: ApiServer, registrations: float, timeout_s: float = 120.0) -> None:
    """Until ``producer`` holds one more decode registration than
    ``registrations``, not resolved (WAITING for a prefill under its transfer id)."""
    def holds() -> bool:
        step_reports(producer)
        return (metric(producer.url, "rdma_kv_events_total", event="push_registrations") > registrations
                and metric(producer.url, "rdma_kv_resource", resource="pushes_running") >= 1)

    wait_for(f"{producer.name}: the decode's registration", holds, timeout_s, poll_s=0.2)


def wait_producer_counted(p: ApiServer, d: ApiServer, before: dict[str, float], key: str, n: float) -> None:
    """Until the producer's ``key`` grew by at least ``n`` since ``before``.
    A producer resolves a push on its own threads, possibly after its last
    engine step; its counters reach ``/metrics`` only when the engine steps
    again (``step_reports``). The caller then asserts the exact count."""
    def counted() -> bool:
        step_reports(p)
        return counts(p, d, before)[key] >= n

    wait_for(f"the producer's {key} count to grow by {n:g}", counted, 60, poll_s=0.5)


def decode_idle(d: ApiServer) -> bool:
    """The decode holds no request, no KV block, no load and no push."""
    step_reports(d)
    return (metric(d.url, "vllm:num_requests_running") == 0 and metric(d.url, "vllm:num_requests_waiting") == 0
            and metric(d.url, "vllm:kv_cache_usage_perc") == 0
            and metric(d.url, "rdma_kv_resource", resource="inflight_loads") == 0
            and metric(d.url, "rdma_kv_resource", resource="pushes_running") == 0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A plain server; a push prefill and decode, both also registered with
    a discovery address where the moriio-mode router of the second test
    listens (until then nobody does: ZMQ queues, nothing breaks); a push
    prefill with other weights (registered nowhere); a push prefill that
    the producer-killed test SIGKILLs (``doomed``)."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    other_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-other"), seed=1)
    log_dir = tmp_path_factory.mktemp("push-logs")
    discovery = f"127.0.0.1:{free_port()}"
    p_port, d_port = free_port(), free_port()

    def registered(role: str, port: int) -> dict[str, Any]:
        return rdma_config(role, mode="push", router_discovery_address=discovery,
                           router_http_address=f"127.0.0.1:{port}", **STARVATION_BOUNDS)

    made = {"plain": ApiServer("plain", model_dir, log_dir),
            "prefill": ApiServer("prefill-push", model_dir, log_dir, port=p_port,
                                 kv_transfer_config=registered("kv_producer", p_port)),
            "other": ApiServer("prefill-push-other-weights", other_dir, log_dir,
                               kv_transfer_config=push_config("kv_producer")),
            "decode": ApiServer("decode-push", model_dir, log_dir, port=d_port,
                                kv_transfer_config=registered("kv_consumer", d_port)),
            "doomed": ApiServer("prefill-push-doomed", model_dir, log_dir,
                                kv_transfer_config=push_config("kv_producer"))}
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
    before = counts(p, d)
    many = [ROUTER_PROMPTS[i % len(ROUTER_PROMPTS)] for i in range(128)]
    with Router("router-push", servers["log_dir"], prefill=[p.url], decode=[d.url]) as router:
        router.wait_healthy(120)
        sent = routed(router, plain, reference, ROUTER_PROMPTS, p, d)
        sent += routed(router, plain, reference, many, p, d, in_flight=128)
        sent += routed(router, plain, reference, ROUTER_PROMPTS, p, d, stream=True)
    # A load that failed and recomputed still equals plain: say why before waiting for counts it left short.
    assert counts(None, d, before)["load_failed_lines"] == 0, \
        [line for line in d.log().splitlines() if "KV load failed" in line][-5:]
    wait_producer_counted(p, d, before, "done", sent)
    grew = counts(p, d, before)
    assert grew["pushed_ok"] == sent, d.log()[-3000:]
    assert grew["loads_ok"] == sent
    assert grew["loads_failed"] == 0
    assert grew["load_failed_lines"] == 0, d.log()[-3000:]
    assert grew["done"] == sent, p.log()[-3000:]
    assert grew["written"] > 0
    wait_for("the producer to release every lease",
             lambda: (step_reports(p), metric(p.url, "rdma_kv_leases_held") == 0)[1], 60, poll_s=0.5)

    # Control: the same decode, KV pushed by a producer with other weights.
    differ = []
    for prompt in ROUTER_PROMPTS[1:]:  # the 7-token prompt fits in one block: its output may coincide
        params = prefill_params(other, prompt)
        out = complete(d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params, timeout_s=CLIENT_TIMEOUT_S)
        assert out["status"] == 200, out
        differ.append(out["text"] != expected(plain, reference, prompt))
    assert all(differ), f"a producer with other weights left completions unchanged: {differ}"
    assert counts(p, d, before)["loads_failed"] == 0


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
              "regs": metric(p.url, "rdma_kv_events_total", event="push_registrations"),
              **counts(p, d)}
    many = [ROUTER_PROMPTS[i % len(ROUTER_PROMPTS)] for i in range(32)]
    with Router("router-moriio", servers["log_dir"], prefill=[], decode=[],
                extra_args=["--kv-connector", "moriio", "--vllm-discovery-address", servers["discovery"]]) as router:
        router.wait_healthy(120)
        sent = routed(router, plain, reference, ROUTER_PROMPTS, p, d)
        sent += routed(router, plain, reference, many, p, d, in_flight=16)
        sent += routed(router, plain, reference, ROUTER_PROMPTS, p, d, stream=True)
    assert metric(d.url, "rdma_kv_pushed_loads_total", outcome="ok") - before["loads"] == sent, d.log()[-3000:]
    wait_producer_counted(p, d, before, "done", sent)
    grew = counts(p, d, before)
    assert grew["loads_failed"] == 0
    assert grew["load_failed_lines"] == 0, d.log()[-3000:]
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
    grew: dict[str, float] = {}

    def counted() -> bool:
        # The producer's counters reach /metrics with its steps' stats, a step or more after the push
        # resolved, and are read one at a time: wait until both moved.
        step_reports(p)
        for name in before:
            grew[name] = metric(p.url, f"rdma_kv_{name}") - before[name]
        return grew["push_written_bytes_total"] > 0 and grew["push_overlapped_bytes_total"] > 0

    wait_for("the producer's count of bytes written during the prefill's forward pass", counted, 60, poll_s=0.5)
    written, overlapped = grew["push_written_bytes_total"], grew["push_overlapped_bytes_total"]
    assert overlapped <= written, (overlapped, written, p.log()[-3000:])
    print(f"decode registered first: {overlapped / written:.0%} of {int(written)} bytes written during the "
          "prefill's forward pass")


def test_push_producer_killed_after_the_decode_registered_recomputes(servers: dict[str, Any]) -> None:
    """A producer SIGKILLed *after the decode registered its blocks with it
    and before it wrote any* (the registration WAITING for its prefill under
    the transfer id, observed on the producer's own gauge). Truly mid-write
    is not deterministic here: a tiny model's push is written within a
    millisecond of its prefill's end. Before, one good sequential push from
    it brought the connections up (handshake, PUSH_HELLO, endpoints), so the
    death is met by a live connection, not a refused handshake.

    The decode's next PUSH_QUERY meets a refused connection: the push
    resolves (nothing of a dead process writes), the load fails, the decode
    recomputes (``kv_load_failure_policy: recompute``): the completion
    equals plain, well within the time the registration would have waited.
    Afterwards the decode holds no block, load or push, and serves pushes
    from the live producer."""
    plain, p, d, doomed = servers["plain"], servers["prefill"], servers["decode"], servers["doomed"]
    reference: dict[tuple[str, int], str] = {}
    prompt = ROUTER_PROMPTS[2]  # 71 tokens: three blocks
    params = prefill_params(doomed, prompt)
    out = complete(d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params, timeout_s=CLIENT_TIMEOUT_S)
    assert out["status"] == 200 and out["text"] == expected(plain, reference, prompt), out
    before = counts(None, d)

    leg = Leg(d, prompt, router_request_id(params), concurrent_params(f"tx-{uuid.uuid4().hex}", decode=True))
    wait_registered(doomed, metric(doomed.url, "rdma_kv_events_total", event="push_registrations"))
    doomed.kill()
    answer = leg.result(120)
    assert answer["status"] == 200 and answer["text"] == expected(plain, reference, prompt), answer

    grew = counts(None, d, before)
    assert grew["pushed_failed"] == 1 and grew["loads_failed"] == 1 and grew["pushed_ok"] == 0, grew
    # Resolved by the refused connection (producer_gone), not by waiting out a bound.
    assert grew["producer_gone"] == 1 and grew["load_failed_lines"] >= 1, (grew, d.log()[-3000:])
    # Every block back, nothing left in flight; and the decode still takes pushes.
    wait_for("the decode to hold nothing", lambda: decode_idle(d), 60, poll_s=0.5)
    params = prefill_params(p, prompt)
    out = complete(d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params, timeout_s=CLIENT_TIMEOUT_S)
    assert out["status"] == 200 and out["text"] == expected(plain, reference, prompt), out


def test_push_decode_aborted_while_registered_producer_writes_nothing(servers: dict[str, Any]) -> None:
    """A decode request whose client hangs up while its push is registered
    with the producer and not written (WAITING for its prefill under the
    transfer id): vLLM aborts the request, the decode asks the producer to
    abort (PUSH_QUERY ``abort``), and the producer resolves it ABORTED
    (``rdma_kv_pushes_total{outcome="aborted"}``) having written nothing.
    (Aborting while a write batch is on the wire is not deterministic here:
    it lasts under a millisecond; the harness test
    ``test_a_decode_abort_mid_push_keeps_its_blocks_until_no_write_can_land``
    covers it.)

    Then the same transfer's prefill leg runs and a retried decode leg
    registers: the producer writes the retry only (one push done, the
    aborted allocation never written), releases the lease (leases held
    back to 0), and the retry's completion equals plain. Both servers end
    holding nothing."""
    plain, p, d = servers["plain"], servers["prefill"], servers["decode"]
    reference: dict[tuple[str, int], str] = {}
    prompt = ROUTER_PROMPTS[2]
    params = prefill_params(p, prompt)  # the producer's address, and a good push first
    out = complete(d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params, timeout_s=CLIENT_TIMEOUT_S)
    assert out["status"] == 200 and out["text"] == expected(plain, reference, prompt), out
    before = counts(p, d)
    transfer_id, request_id = f"tx-{uuid.uuid4().hex}", router_request_id(params)

    leg = Leg(d, prompt, request_id, concurrent_params(transfer_id, decode=True), stream=True)
    wait_registered(p, before["registrations"])
    leg.hang_up()

    wait_producer_counted(p, d, before, "aborted", 1)  # the producer resolved the push ABORTED
    # The decode counts the abort on its RPC thread once the producer's answer arrives, and
    # reports it at a later step: wait until it holds nothing (decode_idle steps it; the
    # counts are published with the gauges that reach 0), then read its counts.
    wait_for("the decode to hold nothing", lambda: decode_idle(d), 60, poll_s=0.5)
    grew = counts(p, d, before)
    assert grew["aborted"] == 1 and grew["done"] == 0 and grew["written"] == 0, grew
    assert grew["failed"] == 0 and grew["refused"] == 0, grew
    assert metric(p.url, "rdma_kv_resource", resource="pushes_running") == 0
    # The decode's push resolved without data (the producer's ABORTED): an abort, not a failure
    # (no load record, no "KV load failed"); the request is gone.
    assert grew["pushed_aborted"] == 1 and grew["pushed_failed"] == 0 and grew["pushed_ok"] == 0, grew
    assert grew["loads_ok"] == 0 and grew["loads_failed"] == 0 and grew["loads_aborted"] == 1, grew
    assert grew["load_failed_lines"] == 0, d.log()[-3000:]

    # The transfer's prefill leg, then a retried decode leg under the same id.
    out = complete(p.url, prompt, max_tokens=1, kv_transfer_params=concurrent_params(transfer_id, decode=False))
    assert out["status"] == 200, out
    retry = Leg(d, prompt, request_id, concurrent_params(transfer_id, decode=True))
    answer = retry.result(120)
    assert answer["status"] == 200 and answer["text"] == expected(plain, reference, prompt), answer
    wait_producer_counted(p, d, before, "done", 1)
    grew = counts(p, d, before)
    assert grew["done"] == 1 and grew["aborted"] == 1 and grew["pushed_ok"] == 1, grew
    # The retry loaded; nothing failed, nothing was logged as a failed load.
    assert grew["loads_failed"] == 0 and grew["loads_ok"] == 1 and grew["load_failed_lines"] == 0, grew
    wait_for("the producer to release every lease",
             lambda: (step_reports(p), metric(p.url, "rdma_kv_leases_held") == 0)[1], 60, poll_s=0.5)
    assert metric(p.url, "rdma_kv_resource", resource="pushes_running") == 0
    wait_for("the decode to hold nothing", lambda: decode_idle(d), 60, poll_s=0.5)
