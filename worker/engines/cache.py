"""Where engines keep files they make once (converted weights, a voice clip)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$OMNI_CACHE_DIR, else ~/.cache/omnifabric."""
    return Path(os.environ.get("OMNI_CACHE_DIR") or Path.home() / ".cache" / "omnifabric")
