"""``python -m tensorwire.soak.plot RESULT.json OUT.png``: RSS, threads and live leases over a soak / load run.

Drawn with Pillow (already a dependency of the encoder), so the figure needs no plotting package. One panel per
quantity, one line per long-lived process (the soak process, worker 0, client 0) plus the workers' live leases.
"""

from __future__ import annotations

import json
import sys
from typing import Any

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 1000, 260, 80, 170, 30, 40
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _series(timeline: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {"RSS (MiB)": {}, "threads": {}, "live leases": {}}
    for p in timeline:
        t = p["t_s"]
        procs = {
            "soak+proxy+relays": p["self"],
            **{f"worker{k}": v for k, v in p["workers"].items() if k == "0"},
            **{f"client{k}": v for k, v in p["clients"].items() if k == "0"},
        }
        for name, s in procs.items():
            if s["rss_bytes"] < 0:  # the process was gone at this sample
                continue
            panels["RSS (MiB)"].setdefault(name, []).append((t, s["rss_bytes"] / 2**20))
            panels["threads"].setdefault(name, []).append((t, s["threads"]))
        for k, w in p["workers"].items():
            if w.get("live_leases") is not None:
                panels["live leases"].setdefault(f"worker{k}", []).append((t, w["live_leases"]))
    return panels


def draw(result: dict[str, Any], out: str) -> None:
    from PIL import Image, ImageDraw

    panels = _series(result["timeline"])
    img = Image.new("RGB", (W, H * len(panels) + 40), "white")
    d = ImageDraw.Draw(img)
    cfg = result.get("config", {})
    d.text(
        (PAD_L, 8),
        f"tensorwire {result.get('mode', 'soak')}: concurrency {cfg.get('concurrency')}, faults "
        f"{','.join(cfg.get('faults', [])) or 'none'}, {result.get('duration_s')} s",
        fill="black",
    )
    t_max = max((p["t_s"] for p in result["timeline"]), default=1.0) or 1.0
    for row, (title, lines) in enumerate(panels.items()):
        top = 40 + row * H
        x0, x1, y0, y1 = PAD_L, W - PAD_R, top + PAD_T, top + H - PAD_B
        values = [v for pts in lines.values() for _, v in pts] or [0.0]
        lo, hi = min(0.0, min(values)), max(values) * 1.1 or 1.0
        d.rectangle([x0, y0, x1, y1], outline="black")
        d.text((8, top + 8), title, fill="black")
        for frac in (0.0, 0.5, 1.0):
            y = y1 - frac * (y1 - y0)
            d.text((8, y - 6), f"{lo + frac * (hi - lo):.0f}", fill="gray")
            d.line([x0, y, x1, y], fill=(225, 225, 225))
        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
            x = x0 + frac * (x1 - x0)
            d.text((x - 10, y1 + 6), f"{frac * t_max:.0f}s", fill="gray")
        for i, (name, pts) in enumerate(sorted(lines.items())):
            color = COLORS[i % len(COLORS)]
            xy = [(x0 + t / t_max * (x1 - x0), y1 - (v - lo) / (hi - lo) * (y1 - y0)) for t, v in pts]
            if len(xy) > 1:
                d.line(xy, fill=color, width=2)
            d.text((x1 + 10, y0 + 14 * i), name, fill=color)
    img.save(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n")[0], file=sys.stderr)
        return 2
    with open(args[0]) as f:
        draw(json.load(f), args[1])
    print(f"wrote {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
