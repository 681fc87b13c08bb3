"""Client units -> model units of exactly the length an engine needs.

Clients may send any length the protocol allows (0.25-4 s); MiniCPM-o takes 1.035 s first
and 1 s after. The first unit is padded at its start with the difference (35 ms of
silence), so from then on every 1 s of client audio is one model unit and nothing lags.
What does not fill a unit waits for the next client unit; frames, force_listen and the
slice count ride on the next model unit made.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from omnifabric.worker.units import UnitInput


class Rechunker:
    """Joins and splits UnitInputs into model units of `first`, then `size` samples."""

    def __init__(self, first: int, size: int) -> None:
        if size <= 0 or first < size:
            raise ValueError(f"unit sizes must satisfy first >= size > 0, got {first}, {size}")
        self.size = size
        self._need = first
        """Samples the next model unit takes (the first counts the padding)."""
        self._buffer = np.zeros(first - size, np.float32)
        self._frames: list[bytes] = []
        self._force_listen = False
        self._max_slice_nums = 0

    @property
    def buffered_samples(self) -> int:
        return int(self._buffer.size)

    def push(self, unit: UnitInput) -> list[UnitInput]:
        """Take a client unit; return the model units it completes (maybe none), each
        carrying the client unit's seq and arrival time."""
        self._buffer = np.concatenate([self._buffer, unit.pcm.astype(np.float32, copy=False)])
        if unit.frames:
            self._frames = list(unit.frames)
        self._force_listen = self._force_listen or unit.force_listen
        self._max_slice_nums = unit.max_slice_nums or self._max_slice_nums
        out: list[UnitInput] = []
        while self._buffer.size >= self._need:
            chunk, self._buffer = self._buffer[: self._need], self._buffer[self._need :]
            self._need = self.size
            out.append(
                replace(
                    unit,
                    pcm=chunk,
                    frames=self._frames,
                    force_listen=self._force_listen,
                    max_slice_nums=self._max_slice_nums,
                )
            )
            self._frames, self._force_listen, self._max_slice_nums = [], False, 0
        return out
