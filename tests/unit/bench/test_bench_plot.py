"""The ``bench broadcast`` figure: drawn from a result document, or skipped with the install hint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tensorwire.bench import _plot

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _doc() -> dict:
    rows, ratios = [], []
    for gap in (0.0, 2.0):
        for payload in ("1KiB", "sched"):
            case = payload + (f"@{gap:g}ms" if gap else "")
            for tp in (2, 4, 8):
                for k, backend in enumerate(("shm", "uds", "vllm", "gloo")):
                    med = 0.01 * (k + 1) * tp
                    rows.append(
                        {
                            "backend": backend,
                            "tp": tp,
                            "case": case,
                            "payload": payload,
                            "gap_ms": gap,
                            "median_ms": med,
                            "p99_ms": 2 * med,
                        }
                    )
                ratios.append({"case": case, "tp": tp, "shm_over_vllm": 1 / 3})
    rows.append({"backend": "vllm", "tp": 8, "error": "boom"})  # a failed group is left out, not fatal
    return {
        "config": {"tp": [2, 4, 8], "backends": ["shm", "uds", "gloo", "vllm"]},
        "results": rows,
        "ratios": ratios,
        "machine": {"cpu_count": 16, "hostname": "h"},
        "vllm": {"available": True, "version": "0.33.0"},
    }


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (pip install matplotlib)")
def test_the_plot_is_a_png_with_one_panel_per_case(tmp_path: Path) -> None:
    from PIL import Image

    src = tmp_path / "broadcast.json"
    src.write_text(json.dumps(_doc()))
    out = _plot.plot_broadcast_file(str(src))
    assert out == tmp_path / "broadcast.png"
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width > img.height > 300


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed")
def test_without_matplotlib_the_plot_is_skipped_with_the_install_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _plot.plot_broadcast(_doc(), tmp_path / "x.png") is None
    assert "pip install matplotlib" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
