"""Shared test settings: one time factor for every timeout (OMNI_TEST_TIME_FACTOR)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Multiply every timeout in the tests by this (slow or loaded CI machines).
TIME_FACTOR = float(os.environ.get("OMNI_TEST_TIME_FACTOR", "1"))


def scaled(seconds: float) -> float:
    """A timeout in seconds, scaled by OMNI_TEST_TIME_FACTOR."""
    return seconds * TIME_FACTOR
