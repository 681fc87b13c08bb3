"""Building what engines make once into the cache (omnifabric.common.paths.cache_root)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
