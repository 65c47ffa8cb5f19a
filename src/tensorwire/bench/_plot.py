"""The ``bench broadcast`` figure: latency to the last reader per case and TP size, one line per backend.

One panel per payload and message gap; median latency (log scale) with p99 dashed. Needs matplotlib; without
it the plot is skipped with a message. Redraw:
``python -m tensorwire.bench broadcast --replot RESULT.json [--plot OUT.png]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLORS = {"shm": "#1f77b4", "shm_pickle": "#2ca02c", "uds": "#ff7f0e", "vllm": "#d62728"}


def plot_broadcast(doc: dict[str, Any], out: str | Path) -> Path | None:
    """Draw ``doc`` (a ``broadcast`` result) into ``out``; None (and a message on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    rows = [r for r in doc["results"] if "median_ms" in r]
    payloads = list(dict.fromkeys(r["payload"] for r in rows))
    gaps = sorted({r["gap_ms"] for r in rows})
    backends = [b for b in COLORS if any(r["backend"] == b for r in rows)]
    tps = doc["config"]["tp"]
    ratio = {(r["case"], r["tp"]): r["shm_over_vllm"] for r in doc.get("ratios", [])}
    fig, axes = plt.subplots(
        len(gaps),
        len(payloads),
        figsize=(max(8.0, 3.2 * len(payloads)), 3.0 * len(gaps) + 1.0),
        squeeze=False,
        sharex=True,
    )
    for gi, gap in enumerate(gaps):
        for pi, payload in enumerate(payloads):
            ax = axes[gi][pi]
            case = None
            for b in backends:
                pts = sorted(
                    (r["tp"], r["median_ms"] * 1e3, r["p99_ms"] * 1e3, r["case"])
                    for r in rows
                    if r["backend"] == b and r["payload"] == payload and r["gap_ms"] == gap
                )
                if not pts:
                    continue
                case = pts[0][3]
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] for p in pts], "o-", color=COLORS.get(b), label=b)
                ax.plot(xs, [p[2] for p in pts], "--", color=COLORS.get(b), alpha=0.4, linewidth=1)
            if case is not None:
                qs = [f"TP{tp} {ratio[(case, tp)]:.2f}x" for tp in tps if ratio.get((case, tp)) is not None]
                if qs:
                    ax.text(
                        0.02,
                        0.98,
                        "shm/vLLM " + ", ".join(qs),
                        transform=ax.transAxes,
                        va="top",
                        fontsize=7,
                        color=COLORS["shm"],
                    )
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            ax.margins(y=0.25)
            ax.set_xticks(tps)
            ax.set_title(case or payload, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if pi == 0:
                ax.set_ylabel(f"gap {gap:g} ms: latency, µs")
            if gi == len(gaps) - 1:
                ax.set_xlabel("TP size")
    m = doc.get("machine", {})
    v = doc.get("vllm", {})
    vtxt = f"vLLM {v.get('version')} MessageQueue" if v.get("available") else "vLLM: not run"
    fig.suptitle(
        f"latency to the last reader (median, p99 dashed): tensorwire vs {vtxt}\n{m.get('cpu_count')} CPUs "
        f"{m.get('cpu_model', '')}, {m.get('hostname', '')}, {m.get('date_utc', '')}",
        fontsize=9,
    )
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels) or 1, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_broadcast_file(result: str, out: str | None = None) -> Path | None:
    """Plot a result JSON; ``out`` defaults to the same path with ``.png``."""
    path = plot_broadcast(json.loads(Path(result).read_text()), out or Path(result).with_suffix(".png"))
    if path is not None:
        print(f"wrote {path}")
    return path
