"""The OpenAI Realtime API's audio formats: what the client sends and hears, and the
conversions to and from what the engine hears (16 kHz float32) and speaks (24 kHz float32)."""

from __future__ import annotations

import binascii
from typing import Any

import numpy as np

from omnifabric.edge import codec, g711, pcm
from omnifabric.edge.chat import MAX_AUDIO_SECONDS
from omnifabric.edge.dialects.openai.wire import BadParam
from omnifabric.edge.errors import InvalidPayload

#: Audio formats: `type` -> (sample rate, bytes a sample).
FORMATS = {"audio/pcm": (24000, 2), "audio/pcmu": (8000, 1), "audio/pcma": (8000, 1)}
#: The rate the engine hears and the rate it speaks.
ENGINE_IN_RATE, ENGINE_OUT_RATE = 16000, 24000


def rate(kind: str) -> int:
    """The sample rate of the format `kind`."""
    return FORMATS[kind][0]


def parse_format(value: Any, where: str) -> str:
    """An audio format object ({type, rate}) -> its type; BadParam naming the field
    otherwise (any JSON value: a list as the type is no format, not a crash)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in FORMATS:
        param = f"{where}.type" if isinstance(value, dict) else where
        raise BadParam(param, f"{where}.type must be one of {', '.join(FORMATS)}")
    given = value.get("rate")
    if given is not None and given != rate(kind):
        raise BadParam(f"{where}.rate", f"{where}.rate: {kind} is {rate(kind)} Hz")
    return kind


def format_json(kind: str) -> dict[str, Any]:
    return {"type": kind, "rate": rate(kind)} if kind == "audio/pcm" else {"type": kind}


def decode_audio(data: bytes, kind: str) -> np.ndarray:
    """Client audio bytes in `kind` -> float32 samples at its rate."""
    if kind == "audio/pcmu":
        samples = g711.mulaw_decode(data)
    elif kind == "audio/pcma":
        samples = g711.alaw_decode(data)
    else:
        samples = np.frombuffer(data[: len(data) - len(data) % 2], dtype="<i2")
    return samples.astype(np.float32) / 32768.0


def heard(data: bytes, kind: str) -> np.ndarray:
    """Client audio bytes in `kind` as the engine hears them (float32 16 kHz)."""
    return pcm.resample(decode_audio(data, kind), rate(kind), ENGINE_IN_RATE)


def _encoded(audio: np.ndarray, kind: str) -> bytes:
    samples = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    if kind == "audio/pcmu":
        return g711.mulaw_encode(samples)
    if kind == "audio/pcma":
        return g711.alaw_encode(samples)
    return samples.tobytes()


def encode_audio(pcm24k_f32: bytes, kind: str) -> bytes:
    """The engine's speech (float32 24 kHz) -> bytes in `kind`, in one piece."""
    audio = np.frombuffer(pcm24k_f32, dtype="<f4")
    if rate(kind) != ENGINE_OUT_RATE:
        audio = pcm.resample(audio, ENGINE_OUT_RATE, rate(kind))
    return _encoded(audio, kind)


class SpeechOut:
    """The engine's speech as one stream in `kind`, delta by delta: one resampler for the
    stream (no seam between deltas), its last few ms given by flush()."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._resampler = (
            pcm.Resampler(ENGINE_OUT_RATE, rate(kind)) if rate(kind) != ENGINE_OUT_RATE else None
        )

    def encode(self, pcm24k_f32: bytes) -> bytes:
        audio = np.frombuffer(pcm24k_f32, dtype="<f4")
        if self._resampler is not None:
            audio = self._resampler.process(audio)
        return _encoded(audio, self.kind)

    def flush(self) -> bytes:
        """What the resampler still holds, encoded (b"" without one)."""
        if self._resampler is None:
            return b""
        return _encoded(self._resampler.flush(), self.kind)


def b64(value: Any, where: str) -> bytes:
    """A base64 field (empty allowed: an append of nothing) -> bytes."""
    if not isinstance(value, str):
        raise InvalidPayload(f"{where} must be a base64 string")
    try:
        return codec.b64decode(value)
    except (binascii.Error, ValueError):
        raise InvalidPayload(f"{where} base64 decode failed") from None


def speech_ms(pcm24k_f32: bytes) -> float:
    """How long the engine's speech (float32 24 kHz bytes) plays, milliseconds."""
    return len(pcm24k_f32) / 4 / ENGINE_OUT_RATE * 1000


class InputBuffer:
    """The input audio buffer of client-driven turns: appends as they came, each at its
    format's rate, at most MAX_AUDIO_SECONDS."""

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, int]] = []
        self.seconds = 0.0

    def __bool__(self) -> bool:
        return bool(self._runs)

    def append(self, samples: np.ndarray, at_rate: int) -> None:
        """Add an append's samples; BadParam("audio") when the buffer would pass the cap."""
        seconds = self.seconds + samples.size / at_rate
        if seconds > MAX_AUDIO_SECONDS:
            message = f"the input audio buffer holds at most {MAX_AUDIO_SECONDS} s: commit it first"
            raise BadParam("audio", message)
        if self._runs and self._runs[-1][1] == at_rate:
            held, _ = self._runs[-1]
            self._runs[-1] = (np.concatenate([held, samples]), at_rate)
        else:
            self._runs.append((samples, at_rate))
        self.seconds = seconds

    def take(self) -> list[tuple[np.ndarray, int]]:
        """Everything, emptied: the runs of one rate each, in order."""
        runs, self._runs, self.seconds = self._runs, [], 0.0
        return runs

    def take_heard(self) -> np.ndarray:
        """Everything as the engine hears it (16 kHz), emptied."""
        heard = [pcm.resample(samples, at, ENGINE_IN_RATE) for samples, at in self.take()]
        return np.concatenate(heard) if heard else np.zeros(0, np.float32)
