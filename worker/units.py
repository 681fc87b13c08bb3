"""A unit of client input, as the session's unit loop and the re-chunker take it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class UnitInput:
    """One unit of input; `received_at` is time.perf_counter() at receipt."""

    seq: int
    pcm: np.ndarray
    frames: list[bytes] = field(default_factory=list)
    force_listen: bool = False
    max_slice_nums: int = 0
    received_at: float = field(default_factory=time.perf_counter)
