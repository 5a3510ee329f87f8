"""The sweep as one figure: GB/s against descriptor size, one line per
backend (``plot_sweep``); and the scale curves: GB/s and per-request
latency against concurrent requests and producers (``plot_scale``).

Median over reps with a min-max band, log2 x axis labelled in KiB/MiB,
descriptors per point on the top axis, a title naming host, UCX version and
date, and a footer saying what one point moved and which backends were
skipped (with why). Written with matplotlib's object API and the Agg canvas:
no pyplot state, no display needed.

matplotlib is optional (``pip install 'rdma-kv[plot]'``) and imported only
when a figure is drawn. Imports the stdlib and ``rdma_kv.bench`` siblings.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rdma_kv.bench.sweep import Point, format_nbytes, skipped_notes
from rdma_kv.errors import ConfigError

__all__ = ["plot_scale", "plot_sweep", "require_matplotlib"]

# Fixed colours and styles, so figures from different runs compare at a glance.
STYLES = {
    "rdma-kv": {"color": "#1f77b4", "marker": "o", "linestyle": "-", "label": "rdma-kv (read_prepared)"},
    "nixl": {"color": "#ff7f0e", "marker": "s", "linestyle": "-", "label": "NIXL (UCX backend)"},
    "ucx_perftest": {"color": "#555555", "marker": "^", "linestyle": "--", "label": "ucx_perftest ucp_get -O 64"},
    "cma": {"color": "#2ca02c", "marker": "D", "linestyle": ":", "label": "process_vm_readv (kernel copy limit)"},
    "cma-t2": {"color": "#2ca02c", "marker": "D", "linestyle": ":",
               "label": "process_vm_readv, 2 threads (kernel copy limit)"},
}


def _measured(value: float | None) -> float:
    """A statistic of a point that ``Point.ok`` says has measurements."""
    if value is None:
        raise ValueError("a plotted point has no measurement")
    return value


def _reserve_bottom(fig: Any, bottom: float) -> None:
    """Keep the constrained layout's axes above a footer ``bottom`` high."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    engine = fig.get_layout_engine()
    if isinstance(engine, ConstrainedLayoutEngine):
        engine.set(rect=(0, bottom, 1, 1 - bottom))


def require_matplotlib() -> None:
    """Fail early, before a long sweep, if the figure cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'rdma-kv[plot]' (or pip install matplotlib)") from None


def plot_sweep(points: Sequence[Point], path: str | Path, *, title: str, subtitle: str = "",
               footer: str = "", total_nbytes: int | None = None) -> Path:
    """Draw ``points`` into ``path`` (PNG, or any format matplotlib infers
    from the suffix) and return the path."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    sizes = sorted({p.descriptor_nbytes for p in points})
    if not sizes:
        raise ConfigError("nothing to plot: the sweep has no points")
    fig = Figure(figsize=(10, 6.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ymax = 0.0
    for backend in dict.fromkeys(p.backend for p in points):
        ok = sorted((p for p in points if p.backend == backend and p.ok), key=lambda p: p.descriptor_nbytes)
        if not ok:
            continue
        style: dict[str, Any] = dict(STYLES.get(backend, {"marker": "x", "linestyle": "-", "label": backend}))
        label = style.pop("label")
        version = next((p.result.config.get("nixl_version") for p in ok if p.result.config.get("nixl_version")), "")
        if backend == "nixl" and version:
            label = f"NIXL {version} (UCX backend)"
        x = [p.descriptor_nbytes for p in ok]
        med = [_measured(p.result.median_gbps) for p in ok]
        lo = [_measured(p.result.min_gbps) for p in ok]
        hi = [_measured(p.result.max_gbps) for p in ok]
        ymax = max(ymax, *hi)
        reps = max(len(p.result.gbps) for p in ok)
        (line,) = ax.plot(x, med, linewidth=2, markersize=6, label=f"{label}  (median of {reps})", **style)
        if reps > 1:
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.13, linewidth=0)
            ax.vlines(x, lo, hi, color=line.get_color(), alpha=0.6, linewidth=1)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([format_nbytes(s).replace(" ", "\u2009") for s in sizes])
    pad = 2 ** 0.25
    ax.set_xlim(sizes[0] / pad, sizes[-1] * pad)
    ax.set_ylim(0, max(1.0, ymax * 1.12))
    ax.set_xlabel("descriptor size (bytes per one-sided GET)")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.grid(True, which="major", alpha=0.3)
    if total_nbytes:
        def per_point(x: Any) -> Any:  # descriptors per point <-> size; its own inverse
            return total_nbytes / np.maximum(x, 1e-9)

        top = ax.secondary_xaxis("top", functions=(per_point, per_point))
        top.xaxis.set_major_locator(FixedLocator([total_nbytes / s for s in sizes]))
        top.xaxis.set_minor_locator(NullLocator())
        top.set_xticklabels([_count(total_nbytes // s) for s in sizes])
        top.set_xlabel(f"descriptors per transfer ({format_nbytes(total_nbytes)} each point)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", frameon=True, framealpha=0.9)
    fig.suptitle(title, fontsize=13, fontweight="bold")
    if subtitle:
        ax.set_title(subtitle, fontsize=9.5, color="#333333", pad=30 if total_nbytes else 6)
    notes = [footer] if footer else []
    notes += [f"not plotted: {n}" for n in skipped_notes(points)]
    if notes:
        text = "\n".join(textwrap.fill(n, 150) for n in notes)
        fig.text(0.01, 0.005, text, fontsize=7.5, color="#444444", va="bottom", ha="left")
        bottom = 0.035 + 0.02 * text.count("\n")  # room for the footer below the axes
        _reserve_bottom(fig, bottom)
    out = Path(path)
    fig.savefig(out)
    return out


def _count(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_scale(points: Sequence[Any], path: str | Path, *, title: str, subtitle: str = "",
               footer: str = "") -> Path:
    """Scale curves (:class:`rdma_kv.bench.scale.ScalePoint`): one column per
    axis run (concurrent requests, producers), aggregate GB/s on top and
    p50 (solid) / p99 (dashed) per-request latency below, one colour per
    backend, log2 x axes."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    axes_run = list(dict.fromkeys(p.axis for p in points))
    if not axes_run:
        raise ConfigError("nothing to plot: the scale run has no points")
    fig = Figure(figsize=(6.2 * len(axes_run), 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(2, len(axes_run), squeeze=False)
    for col, axis in enumerate(axes_run):
        top, bottom = grid[0][col], grid[1][col]
        mine = [p for p in points if p.axis == axis]
        xs = sorted({p.concurrency if axis == "concurrency" else p.producers for p in mine})
        for backend in dict.fromkeys(p.backend for p in mine):
            ok = sorted((p for p in mine if p.backend == backend and p.ok),
                        key=lambda p: (p.concurrency, p.producers))
            if not ok:
                continue
            style = dict(STYLES.get(backend, {"marker": "x", "label": backend}))
            label, color, marker = style.pop("label"), style.get("color"), style.get("marker", "o")
            x = [p.concurrency if axis == "concurrency" else p.producers for p in ok]
            s = [p.summary() for p in ok]
            (line,) = top.plot(x, [v["gbps_median"] for v in s], marker=marker, color=color, linewidth=2,
                               label=label)
            top.vlines(x, [v["gbps_min"] for v in s], [v["gbps_max"] for v in s], color=line.get_color(),
                       alpha=0.6, linewidth=1)
            bottom.plot(x, [v["p50_ms"] for v in s], marker=marker, color=line.get_color(), linewidth=2,
                        label=f"{label} p50")
            bottom.plot(x, [v["p99_ms"] for v in s], marker=marker, color=line.get_color(), linewidth=1.2,
                        linestyle="--", label=f"{label} p99")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(xs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([str(x) for x in xs])
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
        top.set_ylim(bottom=0)
        bottom.set_yscale("log")
        what = ("concurrent requests, one producer" if axis == "concurrency"
                else f"producers feeding one consumer ({mine[0].concurrency // max(mine[0].producers, 1)} "
                     "requests each)")
        top.set_title(f"aggregate GB/s vs {what}", fontsize=10)
        top.set_ylabel("GB/s (1e9 B/s)")
        bottom.set_ylabel("per-request latency, ms (log)")
        bottom.set_xlabel(what)
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
    if footer:
        text = textwrap.fill(footer, 40 + 110 * len(axes_run))
        fig.text(0.01, 0.005, text, fontsize=7.5, color="#444444", va="bottom", ha="left")
        bottom_room = 0.035 + 0.02 * text.count("\n")
        _reserve_bottom(fig, bottom_room)
    out = Path(path)
    fig.savefig(out)
    return out
