"""Scale curves (``rdma-kv bench --scale``): argument parsing, the requests drawn and
their check, the table and CSV, and a 2-point real run with tiny sizes (no
timing asserted: only that every point ran, verified and was reported)."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from rdma_kv.bench import runner, scale
from rdma_kv.cli import main
from rdma_kv.errors import ConfigError


def parse(*argv):
    import argparse

    from rdma_kv.cli.bench import add_parser, parse_scale

    root = argparse.ArgumentParser()
    add_parser(root.add_subparsers())
    return parse_scale(root.parse_args(["bench", *argv]))


def test_scale_arguments_parse_with_their_defaults():
    p = parse("--scale", "concurrency,producers")
    # The kernel's two-thread copy limit (cma-t2) is on the same curves by default.
    assert p["axes"] == ["concurrency", "producers"] and p["backends"] == ["rdma-kv", "nixl", "cma-t2"]
    assert parse("--scale", "concurrency", "--vs", "nixl")["backends"] == ["rdma-kv", "nixl", "cma-t2"]
    assert p["concurrency"] == [1, 2, 4, 8, 16, 32, 64, 128, 256] and p["producers"] == [1, 2, 4, 8]
    assert p["request"] == scale.RequestShape(16, 32 << 10) and p["per_producer"] == 8
    p = parse("--scale", "producers", "--producers", "3,1", "--scale-request", "4x4KiB", "--scale-backends", "nixl")
    assert p["producers"] == [1, 3] and p["request"].nbytes == 16 << 10 and p["backends"] == ["nixl"]


@pytest.mark.parametrize("argv, message", [
    (["--scale", "latency"], "expected a comma list of concurrency, producers"),
    (["--scale", "producers", "--producers", "0,2"], "each 1..16"),
    (["--scale", "producers", "--producers", "two"], "comma list of integers or MIN:MAX"),
    (["--scale", "concurrency", "--concurrency", "1:4096"], "each 1..1024"),
    (["--scale", "concurrency", "--scale-request", "16"], "expected BLOCKSxSIZE"),
    (["--scale", "concurrency", "--scale-request", "16x12"], "multiple of 8"),
    (["--scale", "concurrency", "--scale-backends", "mooncake"], "valid: rdma-kv, nixl, cma-t2"),
    (["--scale", "producers", "--producer-requests", "0"], "--producer-requests must be"),
])
def test_bad_scale_arguments_say_what_to_give(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_the_cli_rejects_a_bad_axis_before_running(capsys):
    assert main(["bench", "--scale", "bogus"]) == 2
    assert "expected a comma list of concurrency, producers" in capsys.readouterr().err


def test_the_requests_spread_over_producers_into_blocks_of_their_own():
    requests = scale.draw_requests(seed=1, rep=0, producers=3, concurrency=7, blocks=4, pool_blocks=64)
    assert [p for p, _, _ in requests] == [0, 1, 2, 0, 1, 2, 0]
    local = np.concatenate([ids for _, ids, _ in requests])
    assert sorted(local.tolist()) == list(range(28))
    assert all(len(set(r.tolist())) == 4 and r.max() < 64 for _, _, r in requests)
    assert scale.draw_requests(1, 1, 3, 7, 4, 64)[0][2].tolist() != requests[0][2].tolist()  # a new draw per rep


def test_verify_catches_a_block_from_the_wrong_producer():
    size, pool = 64, 16
    requests = scale.draw_requests(seed=5, rep=2, producers=2, concurrency=2, blocks=3, pool_blocks=pool)
    pools = []
    for t in range(2):
        buf = np.zeros(pool * size, dtype=np.uint8)
        runner.PatternFiller(buf, 5 + t).fill(2)
        pools.append(buf.view(np.uint64).reshape(pool, -1))
    local = np.zeros(6 * size, dtype=np.uint8)
    rows = local.view(np.uint64).reshape(6, -1)
    for p, local_ids, remote_ids in requests:
        rows[local_ids] = pools[p][remote_ids]
    scale.verify(local, requests, 5, 2, size, "test")
    rows[requests[1][1][0]] = pools[0][requests[1][2][0]]  # request 1's first block read from producer 0
    with pytest.raises(runner.VerificationError, match="request 1 .producer 1."):
        scale.verify(local, requests, 5, 2, size, "test")


def test_table_and_csv_report_every_point_and_why_one_is_missing():
    ok = scale.ScalePoint("rdma-kv", "concurrency", 1, 4, 1 << 20, gbps=[2.0, 4.0, 3.0],
                          latencies_s=[0.001 * i for i in range(1, 101)])
    skipped = scale.ScalePoint("nixl", "concurrency", 1, 4, 1 << 20, status="skipped", reason="nixl is not importable")
    table = scale.scale_table([ok, skipped])
    assert "3.00 [2.00 - 4.00]" in table and "skipped" in table and "nixl is not importable" in table
    rows = list(csv.DictReader(io.StringIO(scale.scale_csv([ok, skipped]))))
    assert rows[0]["backend"] == "rdma-kv" and float(rows[0]["p99_ms"]) == pytest.approx(99.01)
    assert float(rows[0]["p50_ms"]) == pytest.approx(50.5) and rows[1]["status"] == "skipped"


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_two_point_run_with_tiny_sizes_writes_table_csv_json_and_plot(tmp_path, capsys):
    files = {k: tmp_path / f"scale.{k}" for k in ("png", "csv", "json")}
    rc = main(["bench", "--scale", "concurrency,producers", "--concurrency", "1,2", "--producers", "1,2",
               "--producer-requests", "1", "--scale-request", "2x4KiB", "--reps", "1", "--scale-backends", "rdma-kv,cma-t2",
               "--plot", str(files["png"]), "--csv", str(files["csv"]), "--json", str(files["json"])])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = list(csv.DictReader(io.StringIO(files["csv"].read_text())))
    assert [(r["axis"], r["backend"], r["producers"], r["concurrency"], r["status"]) for r in rows] == [
        (axis, backend, p, c, "ok") for axis, points in (("concurrency", [("1", "1"), ("1", "2")]),
                                                        ("producers", [("1", "1"), ("2", "2")]))
        for backend in ("rdma-kv", "cma-t2") for p, c in points]
    data = json.loads(files["json"].read_text())
    assert all(len(p["gbps"]) == 1 and p["gbps"][0] > 0 for p in data["scale"])
    assert "concurrency  rdma-kv" in out.out
    if files["png"].exists():
        assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # no matplotlib: the CSV was written and the run said so
        assert "wrote the table as CSV" in out.err


def test_an_unknown_reader_progress_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="reader progress 'spin'"):
        scale.run_axis("concurrency", ["rdma-kv"], request=scale.parse_request("2x4KiB"), reps=1,
                       reader_progress="spin")


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_reader_runs_as_shipped_with_progress_thread(tmp_path, capsys):
    """``--progress thread`` reaches the scale bench's rdma-kv reader (the
    connector's mode: a pump thread and a service thread, ``wait()``
    blocking in C): every request of every point read and verified."""
    out_json = tmp_path / "scale.json"
    rc = main(["bench", "--scale", "concurrency", "--concurrency", "1,8", "--scale-request", "4x4KiB", "--reps", "2",
               "--scale-backends", "rdma-kv", "--progress", "thread", "--json", str(out_json)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    data = json.loads(out_json.read_text())
    assert data["meta"]["reader_progress"] == "thread"
    assert [(p["concurrency"], p["status"], len(p["gbps"])) for p in data["scale"]] == [(1, "ok", 2), (8, "ok", 2)]
    assert "rdma-kv reader: progress=thread" in out.out
