"""How the perf commands run: their event loop (uvloop when installed) and their
timestamped progress lines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def say(who: str, text: str) -> None:
    """A progress line: `[HH:MM:SS] who: text`."""
    print(f"[{time.strftime('%H:%M:%S')}] {who}: {text}", flush=True)


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end on uvloop, or on asyncio's own loop without uvloop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
