"""The engine benchmark's ``note`` (derived from the load each set saw and the hog, never a fixed text) and its
checks before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorwire.bench.vllm_engine.driver import load_class, load_note, main


def _run(lo: float, hi: float) -> dict[str, object]:
    return {"topology": "uniproc", "size_mb": 1, "loadavg_1m": {"min": lo, "max": hi}}


def test_a_set_is_quiet_below_cores_plus_one_and_busy_from_there() -> None:
    assert load_class({"min": 0.5, "max": 2.9}, cores=2) == "quiet"
    assert load_class({"min": 0.5, "max": 3.0}, cores=2) == "busy"
    assert load_class({"min": 6.0, "max": 8.5}, cores=8) == "quiet"


def test_quiet_sets_without_a_hog() -> None:
    note = load_note([_run(1.2, 2.5), _run(0.8, 2.9)], cores=2, hog=False)
    assert note == "2-core CPU, quiet: 1-minute load average 0.8-2.9 during the sets (quiet: below 3); no --hog process"


def test_every_set_busy_beside_the_hog() -> None:
    note = load_note([_run(3.5, 14.0), _run(4.1, 18.2)], cores=2, hog=True)
    assert note.startswith("2-core CPU, busy: 1-minute load average 3.5-18.2 during the sets")
    assert note.endswith("beside a CPU-bound process (--hog: one core spinning)")


def test_some_sets_busy_and_a_failed_set_ignored() -> None:
    runs = [_run(1.0, 2.0), _run(2.5, 6.0), {"topology": "mp", "size_mb": 10, "error": "TimeoutError: ..."}]
    note = load_note(runs, cores=2, hog=False)
    assert note.startswith("2-core CPU, busy in 1 of 2 sets: 1-minute load average 1.0-6.0")


def test_no_set_completed() -> None:
    assert load_note([{"error": "RuntimeError: died"}], cores=2, hog=True) == (
        "2-core CPU, load not recorded (no set completed); beside a CPU-bound process (--hog: one core spinning)"
    )


def test_a_workdir_with_an_earlier_runs_sets_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mp-10mb").mkdir()
    argv = ["--workdir", str(tmp_path), "--sizes", "1", "10", "--model-dir", str(tmp_path / "models")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "mp-10mb" in err and "uniproc-10mb" not in err and "new or empty directory" in err, err
    assert not (tmp_path / "models").exists()  # nothing built, no instance started
