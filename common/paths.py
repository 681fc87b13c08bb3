"""Where omnifabric keeps files it makes or is given at run time."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$OMNI_CACHE_DIR, else ~/.cache/omnifabric: engines' converted weights and voice clips,
    the edge's registered reference voices."""
    return Path(os.environ.get("OMNI_CACHE_DIR") or Path.home() / ".cache" / "omnifabric")
