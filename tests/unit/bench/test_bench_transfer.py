"""``python -m tensorwire.bench transfer``: argument handling and stage accounting (the runs are benchmarks)."""

from __future__ import annotations

import pytest

from tensorwire.bench import transfer


@pytest.mark.parametrize("rows", [["0"], ["-8"], ["8", "0"]])
def test_rows_must_be_positive(rows: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        transfer.main(["--rows", *rows])
    assert info.value.code == 2 and "--rows takes positive row counts" in capsys.readouterr().err


def test_allocate_output_counts_as_transfer_and_the_synced_total_wins() -> None:
    stages = {
        "total": 1.0,
        "request": 0.6,
        "read": 0.3,
        "release": 0.01,
        "encoder.encode": 0.25,
        "encoder.allocate": 0.05,
        "encoder.export": 0.02,
    }
    row = transfer.stage_row(stages, synced_total_ms=1.1)
    assert row["total"] == 1.1  # the stream sync after the fetch counts
    assert row["encode_compute"] == pytest.approx(0.20)  # the encoder's time minus allocate_output
    assert row["transfer"] == pytest.approx(0.90)
    assert row["control_overhead"] == pytest.approx(0.80)
