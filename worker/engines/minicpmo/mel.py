"""The batched step's streaming log-mel: only the frames that changed, every row in one
transform, on the engine's device (issue 51).

The public streaming mel processor (the processor's StreamingMelProcessorExact) appends each
unit's audio to a window of up to 30 s (dropping its oldest 10 s when it reaches 30) and runs
the feature extractor over the whole window every unit: some 3,000 frames of STFT, mel and
log for the ~100 it emits. A frame's log-mel before normalization depends only on the 400
samples around it, reflect-padded at the window's two ends. So a session keeps the raw frames
of its window that no later audio can change (the stable ones: their samples end before the
window does; MelCache), and a unit computes only the others: the new frames, the last ones
the window's right end padded, and after a slide the first two, which its new left end pads.
The normalization then runs as the extractor runs it, over the whole window: under 5 s of
audio a fixed floor, from 5 s on the window's maximum less a dynamic range (the right-padded
frames included), then the Whisper scaling. Every row's frames of a step go through one
windowed FFT, one mel product and one log.

The numbers are the public processor's up to float rounding (our mel product over a few
hundred frames and its over the window round apart by about 1e-7; on a GPU, cuFFT against
the CPU's FFT by about 1e-6), checked in tests/worker/minicpmo/test_mel.py. The processor's
own state (its window, pointers and counters, the extractor's normalization mode) advances as
its process() advances it, so the serial path can take a session over between two steps; a
cache that no longer matches that state (the serial path ran) is dropped and the frames are
computed from the window again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnifabric.worker.engines.minicpmo.slots import to_device

#: The public processor's normalization: under this much audio in the window a fixed floor
#: (log10 units), from it on the window's maximum less a dynamic range (its _extract_full).
DYNAMIC_FROM_S = 5.0
FIXED_FLOOR = -10.0
DYNAMIC_RANGE = 8.0


@dataclass
class MelCache:
    """A session's raw log10 mel frames ([mels, frames], local to the window) that no later
    audio changes, and the processor state they belong to."""

    proc: Any
    raw: torch.Tensor
    base_t: int
    chunk_count: int
    length: int


@dataclass
class MelJob:
    """One row's unit: the frames to compute and what to emit."""

    proc: Any
    kept: torch.Tensor | None
    """Cached frames reused, [mels, n], placed at `kept_at`."""
    kept_at: int
    ranges: list[tuple[int, int]]
    """Frame ranges [start, end) to compute, ascending, around the kept ones."""
    segments: list[np.ndarray]
    """Per range, its samples with the window's reflect padding."""
    frames: int
    stable: int
    emit: tuple[int, int]
    floor: float | None
    """Fixed floor, or None: the dynamic range applies."""
    computed: list[torch.Tensor] = field(default_factory=list)


class StreamingMel:
    """The incremental, batched streaming mel of one model's processor on `device`."""

    def __init__(self, processor: Any, device: torch.device | str) -> None:
        fe = processor.audio_processor
        if getattr(fe, "dither", 0.0):
            raise ValueError("a dithered feature extractor draws noise: no incremental mel")
        self.device = torch.device(device)
        self.filters = torch.from_numpy(fe.mel_filters).to(self.device, torch.float32)
        self.window = torch.hann_window(int(fe.n_fft), device=self.device)
        self.n_fft = int(fe.n_fft)
        self.hop = int(fe.hop_length)

    def plan(self, proc: Any, chunk: np.ndarray, cache: MelCache | None) -> MelJob:
        """Advances the session's processor `proc` by `chunk` as its process() does and
        returns the frames to compute. Its extractor's normalization mode is set as the
        processor sets it (call under the session's swapped state)."""
        fe = proc.feature_extractor
        count_before, length_before, base_before = proc.chunk_count, len(proc.buffer), proc.base_T
        proc.chunk_count += 1
        data = chunk.astype(np.float32, copy=True)
        proc.buffer = data if len(proc.buffer) == 0 else np.concatenate([proc.buffer, data])
        proc._maybe_slide_buffer()
        length = len(proc.buffer)
        if length < self.n_fft:
            raise ValueError(f"buffer length is shorter than n_fft {length} < {self.n_fft}")
        if length < DYNAMIC_FROM_S * proc.sample_rate:
            fe.set_spac_log_norm(log_floor_db=FIXED_FLOOR)
            floor: float | None = FIXED_FLOOR
        else:
            fe.set_spac_log_norm(dynamic_range_db=DYNAMIC_RANGE)
            floor = None
        # The STFT's frames less its last, as the extractor keeps them, of the window it takes
        # (it truncates to n_samples; the processor's sliding keeps the window under that).
        frames = min(length, fe.n_samples) // self.hop
        half = self.n_fft // 2
        stable = min(frames, max(0, (length - half) // self.hop + 1))
        emit = self._emit(proc, frames, stable)
        proc.total_samples_processed += len(chunk)
        proc.is_first = False
        valid = (
            cache is not None
            and cache.proc is proc
            and length <= fe.n_samples
            and (cache.chunk_count, cache.length, cache.base_t)
            == (count_before, length_before, base_before)
        )
        kept, kept_at, ranges = None, 0, [(0, frames)]
        if valid:
            assert cache is not None
            shift = proc.base_T - cache.base_t
            left = -(-half // self.hop) if shift else 0  # frames the new left end pads
            start = left + shift
            if start < cache.raw.shape[1]:
                kept = cache.raw[:, start:]
                kept_at = left
                end = kept_at + kept.shape[1]
                ranges = [(0, left)] if left else []
                ranges.append((end, frames))
        window = proc.buffer[: fe.n_samples]
        ranges = [(a, b) for a, b in ranges if b > a]
        segments = [self._segment(window, a, b) for a, b in ranges]
        return MelJob(proc, kept, kept_at, ranges, segments, frames, stable, emit, floor)

    def _emit(self, proc: Any, frames: int, stable: int) -> tuple[int, int]:
        """The local frames the unit emits, and the processor's pointer moved past them."""
        core_start = proc.last_emitted_T
        core_end = core_start + proc.chunk_frames
        margin = proc.cnn_redundancy_frames
        if proc.base_T + stable < core_end + margin:
            return (0, 0)
        start = max(0, max(0, core_start - margin) - proc.base_T)
        end = core_end + margin - proc.base_T
        start = max(0, min(start, frames))
        end = max(start, min(end, frames))
        proc.last_emitted_T = core_end
        return (start, end)

    def _segment(self, signal: np.ndarray, first: int, end: int) -> np.ndarray:
        """The samples frames [first, end) read, with the reflect padding of a centered STFT
        where they pass the signal's ends."""
        half = self.n_fft // 2
        n = len(signal)
        lo, hi = first * self.hop - half, (end - 1) * self.hop + half
        parts = []
        if lo < 0:
            parts.append(signal[1 : 1 - lo][::-1])
        parts.append(signal[max(0, lo) : min(n, hi)])
        if hi > n:
            parts.append(signal[n - 1 - (hi - n) : n - 1][::-1])
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def run(self, jobs: list[MelJob]) -> list[tuple[torch.Tensor, MelCache]]:
        """Every job's raw frames in one transform; per job its emitted mel [1, mels, n]
        on the device and the cache for its next unit."""
        pieces = [seg for job in jobs for seg in job.segments]
        if pieces:
            flat = to_device(torch.from_numpy(np.concatenate(pieces)), self.device)
            frames, at = [], 0
            for seg in pieces:
                frames.append(flat[at : at + len(seg)].unfold(0, self.n_fft, self.hop))
                at += len(seg)
            spec = torch.fft.rfft(torch.cat(frames) * self.window, dim=-1)
            mel = self.filters.T @ (spec.abs() ** 2).T
            raw = torch.clamp(mel, min=1e-10).log10()
            at = 0
            for job in jobs:
                for a, b in job.ranges:
                    job.computed.append(raw[:, at : at + b - a])
                    at += b - a
        return self._finish(jobs)

    def _finish(self, jobs: list[MelJob]) -> list[tuple[torch.Tensor, MelCache]]:
        """Each row's window of raw frames (kept and computed, in order) in a tensor of its
        own (the session's cache keeps it: a view of a step's tensor would keep every row's
        window alive with it), normalized as the extractor normalizes it (a fixed floor, or
        the window's maximum less the dynamic range), every row at once: a step's host ops
        do not grow with its rows (they grew by four a row, each a kernel on a GPU)."""
        windows, dst, src = [], [], []
        for job in jobs:
            pieces = list(job.computed)
            if job.kept is not None:
                before = sum(1 for _, end in job.ranges if end <= job.kept_at)
                pieces.insert(before, job.kept)
            window = pieces[0].new_empty(pieces[0].shape[0], job.frames)
            at = 0
            for piece in pieces:
                dst.append(window[:, at : at + piece.shape[1]])
                src.append(piece)
                at += piece.shape[1]
            windows.append(window)
        torch._foreach_copy_(dst, src)
        floors = self._floors(jobs, windows)
        longest = max(end - start for start, end in (job.emit for job in jobs))
        emitted = windows[0].new_zeros(len(jobs), windows[0].shape[0], longest)
        emits = [job.emit for job in jobs]
        torch._foreach_copy_(
            [emitted[r, :, : end - start] for r, (start, end) in enumerate(emits)],
            [w[:, start:end] for w, (start, end) in zip(windows, emits, strict=True)],
        )
        out = (torch.maximum(emitted, floors[:, None, None]) + 4.0) / 4.0
        done = []
        for r, (job, window) in enumerate(zip(jobs, windows, strict=True)):
            proc = job.proc
            cache = MelCache(
                proc=proc,
                raw=window[:, : job.stable],
                base_t=proc.base_T,
                chunk_count=proc.chunk_count,
                length=len(proc.buffer),
            )
            start, end = job.emit
            done.append((out[r : r + 1, :, : end - start], cache))
        return done

    def _floors(self, jobs: list[MelJob], windows: list[torch.Tensor]) -> torch.Tensor:
        """[rows]: each row's floor: its fixed one, or its window's maximum less the dynamic
        range (every row's maximum in one call)."""
        fixed = np.array([np.nan if j.floor is None else j.floor for j in jobs], np.float32)
        floors = to_device(torch.from_numpy(fixed), windows[0].device)
        if all(j.floor is not None for j in jobs):
            return floors
        peaks = torch.stack(torch._foreach_max(windows))
        return torch.where(torch.isnan(floors), peaks - DYNAMIC_RANGE, floors)
