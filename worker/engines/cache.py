"""Where engines keep files they make once (converted weights, a voice clip)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """$OMNI_CACHE_DIR, else ~/.cache/omnifabric."""
    return Path(os.environ.get("OMNI_CACHE_DIR") or Path.home() / ".cache" / "omnifabric")


def swap_in(tmp: Path, cache: Path, valid: Callable[[], bool]) -> None:
    """Move a finished ``tmp`` folder to ``cache`` (renames, so readers never see half a
    folder), replacing a stale one. When another process finished the same build first and
    ``valid()`` says its folder is good, theirs is kept."""
    import shutil
    import tempfile

    old = None
    if cache.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{cache.name}.old-", dir=cache.parent))
        os.replace(cache, old / "cache")
    try:
        os.replace(tmp, cache)
    except OSError:
        if not valid():
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
