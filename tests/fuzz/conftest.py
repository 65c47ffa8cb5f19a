"""Loads the fuzz tests' hypothesis profile (fuzz_settings.py)."""

from __future__ import annotations

import fuzz_settings  # noqa: F401  (registers and loads the profile)
