from __future__ import annotations

import sys
from pathlib import Path

# The in-memory exporter/reader fakes live with the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "mm"))
