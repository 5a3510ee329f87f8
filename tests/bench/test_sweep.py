"""Descriptor-size sweep, its table, the progress bar and the plot.

In process with a fake runner, except the last test, which runs a tiny real
sweep (2 sizes, 1 rep, rdma-kv only) through ``rdma-kv bench --plot``.
"""

from __future__ import annotations

import io
import json

import pytest

from rdma_kv.bench import sweep
from rdma_kv.bench.progress import ProgressBar
from rdma_kv.bench.report import Result
from rdma_kv.errors import ConfigError


def test_sizes_and_byte_counts_parse():
    assert sweep.parse_sizes("4KiB:32KiB") == [4096, 8192, 16384, 32768]
    assert sweep.parse_sizes("4096, 64K,1MiB") == [4096, 65536, 1 << 20]
    assert sweep.DEFAULT_SIZES[0] == 4096 and sweep.DEFAULT_SIZES[-1] == 4 << 20 and len(sweep.DEFAULT_SIZES) == 11
    assert sweep.parse_nbytes("64MiB") == 64 << 20 and sweep.format_nbytes(64 << 20) == "64 MiB"
    assert sweep.format_nbytes(12) == "12 B"
    for bad in ("3KiB:4MiB", "4MiB:4KiB", "", "12", "4 parsecs"):
        with pytest.raises(ConfigError):
            sweep.parse_sizes(bad)


def test_every_point_moves_the_same_bytes():
    total = 8 << 20
    for size in sweep.parse_sizes("4KiB:4MiB"):
        w = sweep.workload_for(size, total)
        assert w.transfer_nbytes == total and w.block_nbytes == size
        assert w.descriptor_count == total // size and w.pool_blocks == 2 * w.descriptor_count
    with pytest.raises(ConfigError, match="smaller than descriptor size"):
        sweep.workload_for(4 << 20, 1 << 20)


def _fake_result(name, workload, reps, gbps=(1.0, 2.0, 3.0)):
    r = Result(name, workload.name, descriptors=workload.descriptor_count)
    for rep in range(reps):
        r.nbytes.append(workload.transfer_nbytes)
        r.seconds.append(workload.transfer_nbytes / (gbps[rep % len(gbps)] * workload.block_nbytes / 4096 * 1e9))
        r.ops.append(workload.descriptor_count)
    return r


def _fake_runner(name, workload, reps):
    if name == "nixl":
        return Result.skipped("nixl", workload.name, "nixl is not importable (test)")
    return _fake_result(name, workload, reps)


def test_sweep_runs_each_backend_at_each_size_and_tabulates():
    bar_out = io.StringIO()
    bar = ProgressBar(4, "sweep", stream=bar_out)
    points = sweep.run_sweep([4096, 65536], ["rdma-kv", "nixl"], reps=3, total_nbytes=1 << 20,
                             bar=bar, runner=_fake_runner)
    bar.close()
    assert [(p.backend, p.descriptor_nbytes) for p in points] == [
        ("rdma-kv", 4096), ("nixl", 4096), ("rdma-kv", 65536), ("nixl", 65536)]
    rk = points[0].result
    assert rk.median_gbps == pytest.approx(2.0) and rk.min_gbps == pytest.approx(1.0)
    text = sweep.sweep_table(points)
    assert "2.00 [1.00 - 3.00]" in text and "skipped" in text and "nixl is not importable (test)" in text
    assert "256" in text  # descriptors per point at 4 KiB for 1 MiB
    assert bar_out.getvalue().splitlines() == [bar_out.getvalue().strip()]  # not a TTY: one final line
    assert bar_out.getvalue().startswith("sweep: 4/4 done in")
    data = json.loads(sweep.to_json(points, host="h"))
    assert data["meta"]["host"] == "h" and data["sweep"][0]["descriptor_nbytes"] == 4096
    with pytest.raises(ConfigError, match="unknown"):
        sweep.run_sweep([4096], ["mooncake"], runner=_fake_runner)


def test_progress_bar_on_a_terminal_redraws_and_keeps_lines():
    out = io.StringIO()
    now = [0.0]
    bar = ProgressBar(4, "x", stream=out, interactive=True, width=8, clock=lambda: now[0])
    bar.start("rdma-kv @ 4 KiB")
    now[0] = 10.0
    bar.advance()
    assert bar.render() == "x [##......] 1/4 10 s, ~30 s left  rdma-kv @ 4 KiB"
    bar.write("nixl @ 4 KiB: failed: boom")
    bar.advance(3)
    bar.close("done")
    text = out.getvalue()
    assert "\r\x1b[K" in text and "nixl @ 4 KiB: failed: boom\n" in text
    assert text.endswith("x: 4/4 done in 10.0 s; done\n")


def test_plot_draws_a_readable_png(tmp_path):
    pytest.importorskip("matplotlib")
    from rdma_kv.bench.plot import plot_sweep

    points = sweep.run_sweep(sweep.parse_sizes("4KiB:1MiB"), ["rdma-kv", "nixl", "cma"], reps=3,
                             total_nbytes=4 << 20, runner=_fake_runner)
    path = plot_sweep(points, tmp_path / "sweep.png", title="t", subtitle="host x", footer="f",
                      total_nbytes=4 << 20)
    _assert_nontrivial_png(path)


def _assert_nontrivial_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    pixels = matplotlib.image.imread(str(path))
    h, w = pixels.shape[:2]
    assert w >= 800 and h >= 500
    colours = {tuple(px) for px in pixels[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
    assert len(colours) > 20  # lines, bands, text: not a blank canvas


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tiny_real_sweep_writes_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from rdma_kv.cli import main

    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc = main(["bench", "--plot", str(png), "--json", str(js), "--sizes", "4KiB,64KiB", "--reps", "1",
               "--sweep-backends", "rdma-kv", "--sweep-bytes", "1MiB"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "4 KiB" in out.out and "64 KiB" in out.out and "rdma-kv GB/s" in out.out
    assert "rdma-kv bench --sweep: 2/2 done" in out.err
    _assert_nontrivial_png(png)
    data = json.loads(js.read_text())
    assert data["meta"]["ucx_version"]  # the rdma-kv reader reported the UCX it loaded
    assert [p["status"] for p in data["sweep"]] == ["ok", "ok"]
    assert [p["nbytes"] for p in data["sweep"]] == [[1 << 20], [1 << 20]]
