"""Memory cleanup after a session: gc, and the CUDA cache when torch is already in use."""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class MemoryReport:
    """Memory in use before and after a cleanup, in bytes, on `device`."""

    before_bytes: int
    after_bytes: int
    device: str
    """"cuda" (torch.cuda.memory_allocated) or "cpu" (process RSS)."""

    @property
    def freed_bytes(self) -> int:
        return self.before_bytes - self.after_bytes


def _cuda() -> ModuleType | None:
    """The torch.cuda module if torch is loaded already and CUDA is usable, else None."""
    # Never import torch here: engines that do not need it must not pay for it.
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA setup means "measure RSS instead"
        return None


def rss_bytes() -> int:
    """Resident set size of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def measure() -> tuple[int, str]:
    """Bytes in use now and the device measured ("cuda" or "cpu")."""
    cuda = _cuda()
    if cuda is not None:
        return int(cuda.memory_allocated()), "cuda"
    return rss_bytes(), "cpu"


def freeze_long_lived() -> None:
    """Move every object alive now (modules, engine weights and their Python wrappers) out
    of the collector's reach: later full collections scan only what sessions create.

    Without it each session end's gc.collect() walks the whole heap, 75-130 ms on a
    synthetic worker, holding the GIL and stalling every other session's unit when many
    sessions end together. Call once, after warm-up, when only long-lived objects remain.
    """
    gc.collect()
    gc.freeze()
    return_free_heap()


def return_free_heap() -> bool:
    """Give the heap memory that is free but kept by glibc's allocator back to the system
    (``malloc_trim``); False where the C library has none (musl, macOS).

    Loading models leaves much of it: converting Moonshine's int8 weights to fp32 tensors
    frees ~250 MB of numpy arrays that the process kept resident until trimmed.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


def cleanup() -> MemoryReport:
    """gc.collect(), empty the CUDA cache when torch is loaded, and report before/after."""
    before, device = measure()
    gc.collect()
    cuda = _cuda()
    if cuda is not None:
        cuda.empty_cache()
    after, _ = measure()
    return MemoryReport(before_bytes=before, after_bytes=after, device=device)
