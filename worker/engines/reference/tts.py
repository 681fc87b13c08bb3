"""Speech out for the reference engine, resampled to 24 kHz: espeak-ng (``Speaker``) or a
Piper neural voice (``PiperSpeaker``), each run as a separate program.

espeak-ng (Debian package ``espeak-ng``, GPL-3) is only ever executed, never linked or imported.
It renders fixed text bit-identically, always at 22050 Hz 16-bit mono.
Piper (PyPI ``piper-tts``, GPL-3) is likewise only executed, as one warm child process per
voice (see ``piper.py``); with its noise scales at 0 it also renders fixed text bit-identically.
``make_speaker`` picks one, falling back to espeak-ng with a reason when Piper is unavailable.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from omnifabric.common.resample import resample

if TYPE_CHECKING:
    from omnifabric.worker.engines.reference.piper import PiperProcess

ESPEAK_RATE = 22050
OUTPUT_RATE = 24000
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


def _trim_float(audio: np.ndarray, rate: int) -> np.ndarray:
    """``_trim`` for float audio in [-1, 1] (same level: SILENCE_LEVEL / 32768)."""
    loud = np.flatnonzero(np.abs(audio) > SILENCE_LEVEL / 32768.0)
    if loud.size == 0:
        return audio[:0]
    keep = int(KEEP_SILENCE_S * rate)
    return audio[max(0, loud[0] - keep) : loud[-1] + 1 + keep]


def _to_24k(audio: np.ndarray, rate: int) -> np.ndarray:
    """float32 ``audio`` at ``rate`` resampled to 24 kHz (the fabric's low-pass converter,
    common.resample) and clipped to [-1, 1]."""
    return np.clip(resample(audio, rate, OUTPUT_RATE), -1.0, 1.0).astype(np.float32)


#: The name under which ``voices()`` lists the espeak-ng voice.
ESPEAK_VOICE = "espeak-ng"


class TextToSpeech(Protocol):
    OUTPUT_RATE: int
    #: What ``voices()`` calls the voice this speaker uses.
    voice_name: str

    def synthesize(self, text: str) -> np.ndarray: ...


class Speaker:
    """Text to 24 kHz float32 mono speech with one fixed espeak-ng voice."""

    OUTPUT_RATE = OUTPUT_RATE
    voice_name = ESPEAK_VOICE

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
        return _to_24k(samples.astype(np.float32) / 32768.0, ESPEAK_RATE)


class PiperSpeaker:
    """Text to 24 kHz float32 mono speech with a Piper voice, run in a separate process.

    ``process`` defaults to the worker-wide child of that voice (``piper.shared_process``):
    speakers of the same voice share one warm child and take turns on it (thread-safe).
    Raises ``piper.PiperError`` (a RuntimeError) when piper-tts or the voice is missing.
    """

    OUTPUT_RATE = OUTPUT_RATE

    def __init__(
        self,
        voice: str | None = None,
        length_scale: float = 1.0,
        process: PiperProcess | None = None,
        start: bool = False,
    ) -> None:
        from omnifabric.worker.engines.reference import piper

        self.process = process or piper.shared_process(voice, length_scale)
        self.voice_name = self.process.voice.name
        self.rate = self.process.rate
        if start:
            self.process.start()

    def synthesize(self, text: str) -> np.ndarray:
        """Speech for ``text`` as float32 in [-1, 1] at 24 kHz; empty when there is nothing
        to say. Silence beyond KEEP_SILENCE_S is trimmed at both ends."""
        if not text.strip():
            return np.zeros(0, np.float32)
        audio = _trim_float(self.process.synthesize(text), self.rate)
        if audio.size == 0:
            return np.zeros(0, np.float32)
        return _to_24k(audio, self.rate)


def voices() -> dict[str, str]:
    """The voices a session may choose from here: name -> engine (``"piper"`` or
    ``"espeak"``). Piper voices are those of installed voice packages (e.g.
    ``en_US-joe-medium``), listed only when piper-tts can run; espeak-ng's is ``espeak-ng``."""
    from omnifabric.worker.engines.reference import piper

    found: dict[str, str] = {}
    if piper.unavailable_reason() is None:
        found.update({name: "piper" for name in piper.packaged_voices()})
    if shutil.which("espeak-ng"):
        found[ESPEAK_VOICE] = "espeak"
    return found


class SpeakerChoice(NamedTuple):
    speaker: TextToSpeech
    #: Why the speaker is not the one asked for (a sentence), or None when it is.
    reason: str | None


def make_speaker(
    preferred: str = "piper",
    voice: str | None = None,
    length_scale: float = 1.0,
    start: bool = False,
) -> SpeakerChoice:
    """A speaker for ``voice`` (a name from ``voices()``, a Piper voice's short name such as
    ``joe``, or None for ``preferred``'s default voice). What cannot be had falls back: an
    unavailable voice to ``preferred``'s default, Piper to espeak-ng; ``reason`` then says
    why. ``preferred`` is ``"piper"`` or ``"espeak"``. ``start`` starts Piper's child now
    (~1.3 s), so a failing start also falls back. Raises RuntimeError only when espeak-ng is
    needed and missing."""
    from omnifabric.worker.engines.reference import piper

    if preferred not in ("piper", "espeak"):
        raise ValueError(f"preferred must be 'piper' or 'espeak', not {preferred!r}")
    if voice is not None and voice.lower() in (ESPEAK_VOICE, "espeak"):
        return SpeakerChoice(Speaker(), None)
    if voice is None and preferred == "espeak":
        return SpeakerChoice(Speaker(), None)
    piper_why = piper.unavailable_reason()
    notes: list[str] = []
    if voice is not None:
        if piper_why is not None:
            notes.append(f"voice {voice!r} needs Piper, which is unavailable: {piper_why}")
        else:
            try:
                return SpeakerChoice(PiperSpeaker(voice, length_scale, start=start), None)
            except piper.PiperError as exc:
                notes.append(f"voice {voice!r}: {exc}")
    if preferred == "piper":
        if piper_why is None:
            try:
                speaker = PiperSpeaker(None, length_scale, start=start)
            except piper.PiperError as exc:
                notes.append(f"Piper failed: {exc}")
            else:
                reason = f"{notes[0]}; speaking with {speaker.voice_name}" if notes else None
                return SpeakerChoice(speaker, reason)
        elif voice is None:
            notes.append(f"Piper is unavailable: {piper_why}")
    reason = "; ".join(notes) + "; speaking with espeak-ng" if notes else None
    return SpeakerChoice(Speaker(), reason)


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
