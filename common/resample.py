"""Sample-rate conversion with a real low-pass filter: the one converter of every path that
changes a rate (the OpenAI dialect's 24 kHz, G.711's 8 kHz, chat audio and WAV input, the
reference engine's speech out).

FFmpeg's libswresample (through PyAV, a base dependency) with a windowed-sinc filter of 128
taps per phase, Kaiser window (beta 10), cutoff at 95% of the lower rate's Nyquist. Measured
against soxr's streaming resampler and the linear interpolation it replaces (the figures are
in docs/performance.md, Resampling): tones above the target Nyquist come out at -105 dB or
lower (linear: -2 dB to 0 dB), images of upsampling below -105 dB (linear: -6 dB), flat to 90%
of the Nyquist, and a stream holds back only 4 to 8.5 ms of output (soxr's HQ holds back 20 to
60 ms, up to 115 ms at 8 -> 16 kHz, for its -134 dB). A `Resampler` keeps the filter's state
between chunks, so a stream cut in any pieces comes out as if converted whole.

Services import this from here (edge.pcm re-exports it), since they never import one another.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av

#: libswresample's filter (the aresample filter's options), chosen by the measurements above.
FILTER = {"filter_size": "128", "cutoff": "0.95", "filter_type": "kaiser", "kaiser_beta": "10"}
#: The one-shot's padding on each side, in units of the lower rate's samples: a whole filter
#: length, so the padded edges (not zeros) are what the filter sees past each end.
PAD_SAMPLES = 128


class Resampler:
    """One stream's converter, `src_rate` -> `dst_rate` Hz, float32 mono. `process` takes
    the next chunk (any size, empty too) and returns the output it completes; the filter's
    history carries over, so chunks join with no seam. Output is aligned with the input (no
    phase shift): the last few ms of it (`held`) come out with the next chunk, or `flush`.
    Not thread-safe: one per stream and direction."""

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise ValueError(f"sample rates must be positive ({src_rate} -> {dst_rate} Hz)")
        self.src_rate, self.dst_rate = int(src_rate), int(dst_rate)
        self._swr: av.AudioResampler | None = None
        self._taken = 0  # input samples of the current stream
        self._given = 0  # output samples of the current stream

    @property
    def held(self) -> int:
        """Output samples the converter owes for the input taken so far (its delay now)."""
        return max(0, self._taken * self.dst_rate // self.src_rate - self._given)

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """The output `chunk` (float mono at src_rate) completes, float32 at dst_rate."""
        x = np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1)
        if self.src_rate == self.dst_rate or x.size == 0:
            return x.copy() if self.src_rate == self.dst_rate else np.zeros(0, np.float32)
        import av  # imported on first use: ~60 ms that a process without audio never pays

        frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self.src_rate
        frame.pts = self._taken
        self._taken += x.size
        if self._swr is None:
            self._swr = av.AudioResampler("flt", "mono", self.dst_rate, options=FILTER)
        return self._collect(self._swr.resample(frame))

    def flush(self) -> np.ndarray:
        """The held output, the input's end continued with silence, so the stream's output
        comes to round(n_in * dst_rate / src_rate) samples; the next `process` starts a
        new stream (no history). Silence is pushed before the end of stream because
        libswresample's own flush gives nothing back for a stream shorter than ~12 ms."""
        if self._swr is None:
            return np.zeros(0, np.float32)
        owed = round(self._taken * self.dst_rate / self.src_rate) - self._given
        silence = np.zeros(_pad_length(self.src_rate, self.dst_rate), np.float32)
        tail = [self.process(silence), self._collect(self._swr.resample(None))]
        out = np.concatenate(tail)[: max(owed, 0)]
        self._swr = None
        self._taken = self._given = 0
        return np.pad(out, (0, max(owed, 0) - out.size))

    def _collect(self, frames: list[av.AudioFrame]) -> np.ndarray:
        out = [f.to_ndarray().reshape(-1) for f in frames]
        y = np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)
        self._given += y.size
        return y


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """A whole mono buffer converted with the Resampler's filter: round(n * target / rate)
    float32 samples. Past each end the filter sees the signal continued (odd reflection about
    the end sample; the end value held for buffers shorter than the padding), not silence,
    so a buffer's edges do not fade or ring."""
    x = np.asarray(audio, dtype=np.float32).reshape(-1)
    if rate == target or x.size == 0:
        return x.astype(np.float32)
    n = int(round(x.size * target / rate))
    pad = _pad_length(rate, target)
    if x.size > pad:
        padded = np.pad(x, pad, mode="reflect", reflect_type="odd")
    else:  # odd reflection of a few samples over and over would grow without bound
        padded = np.pad(x, pad, mode="edge")
    converter = Resampler(rate, target)
    y = np.concatenate([converter.process(padded), converter.flush()])
    skip = pad * target // rate
    return y[skip : skip + n]


def _pad_length(rate: int, target: int) -> int:
    """Input samples of padding: PAD_SAMPLES of the lower rate or more, a whole number of
    the ratio's periods so that the padding is a whole number of output samples too."""
    period = Fraction(rate, target).numerator  # input samples per whole output period
    need = -(-PAD_SAMPLES * rate // min(rate, target))
    return -(-need // period) * period
