"""Speech out for the reference engine: espeak-ng run as a separate program, resampled to 24 kHz.

espeak-ng (Debian package ``espeak-ng``, GPL-3) is only ever executed, never linked or imported.
It renders fixed text bit-identically, always at 22050 Hz 16-bit mono.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

ESPEAK_RATE = 22050
TIMEOUT_S = 5.0
# Keep this much of the silence espeak-ng puts around speech (it adds ~0.1-0.3 s).
KEEP_SILENCE_S = 0.05
# |sample| at or below this (int16 units, ~-60 dBFS) counts as silence when trimming.
SILENCE_LEVEL = 32


def _parse_wav(data: bytes) -> np.ndarray:
    """int16 samples of espeak-ng's streamed WAV. Its RIFF and data sizes are placeholders
    (it writes to a pipe), so the data runs to the end of the output."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise RuntimeError("espeak-ng did not produce a WAV stream")
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = pos + 8
        if kind == b"fmt ":
            channels = int.from_bytes(data[body + 2 : body + 4], "little")
            rate = int.from_bytes(data[body + 4 : body + 8], "little")
            bits = int.from_bytes(data[body + 14 : body + 16], "little")
            if (channels, rate, bits) != (1, ESPEAK_RATE, 16):
                raise RuntimeError(
                    f"unexpected espeak-ng format: {channels} ch {rate} Hz {bits} bit"
                )
        elif kind == b"data":
            pcm = data[body:]
            return np.frombuffer(pcm[: len(pcm) // 2 * 2], dtype="<i2")
        pos = body + size + (size & 1)
    raise RuntimeError("espeak-ng WAV stream has no data chunk")


def _trim(samples: np.ndarray, rate: int) -> np.ndarray:
    """Drop leading and trailing silence beyond KEEP_SILENCE_S; all-silent input gives []."""
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > SILENCE_LEVEL)
    if loud.size == 0:
        return samples[:0]
    keep = int(KEEP_SILENCE_S * rate)
    return samples[max(0, loud[0] - keep) : loud[-1] + 1 + keep]


class Speaker:
    """Text to 24 kHz float32 mono speech with one fixed espeak-ng voice."""

    OUTPUT_RATE = 24000

    def __init__(
        self, voice: str = "en-us", rate_wpm: int = 160, executable: str | None = None
    ) -> None:
        found = shutil.which(executable or "espeak-ng")
        if found is None:
            raise RuntimeError(
                f"espeak-ng not found ({executable or 'espeak-ng'} is not an executable on PATH):"
                " install the Debian package with `apt-get install espeak-ng`"
            )
        self.executable = Path(found)
        self.voice = voice
        self.rate_wpm = rate_wpm

    def synthesize(self, text: str) -> np.ndarray:
        """Speech for ``text`` as float32 in [-1, 1] at 24 kHz; empty for blank text."""
        if not text.strip():
            return np.zeros(0, np.float32)
        # "--" ends espeak-ng's options, so text starting with "-" is spoken, not parsed.
        cmd = [str(self.executable), "-v", self.voice, "-s", str(self.rate_wpm), "--stdout"]
        try:
            done = subprocess.run(
                [*cmd, "--", text], capture_output=True, timeout=TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"espeak-ng took longer than {TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip()
            raise RuntimeError(f"espeak-ng failed (exit {done.returncode}): {err}")
        samples = _trim(_parse_wav(done.stdout), ESPEAK_RATE)
        if samples.size == 0:
            return np.zeros(0, np.float32)
        audio = resample_poly(samples.astype(np.float32) / 32768.0, 160, 147)
        return np.clip(audio, -1.0, 1.0).astype(np.float32)


def split_for_speech(text: str, max_chars: int = 18) -> tuple[str, str]:
    """The next piece of ``text`` to speak and the rest. The piece has at most ``max_chars``
    characters, cut at the last word boundary that fits; a longer single word is cut hard."""
    if max_chars < 1:
        raise ValueError("max_chars must be at least 1")
    text = text.lstrip()
    if len(text) <= max_chars:
        return text, ""
    # Whitespace right after max_chars characters still ends a full-length piece.
    head = text[: max_chars + 1]
    cut = max((i for i, ch in enumerate(head) if ch.isspace()), default=-1)
    if cut <= 0:
        return text[:max_chars], text[max_chars:]
    return text[:cut].rstrip(), text[cut:].lstrip()
