"""Registered reference voices: `GET/POST /api/assets/ref_audio`, `DELETE
/api/assets/ref_audio/{id}`, as the reference server offers them.

An upload is a WAV (any encoding edge.pcm.wav_to_pcm16k takes) in base64 with a
display name; it is stored normalized (16 kHz mono 16-bit WAV) as `DIR/<id>.wav`, listed in
`DIR/registry.json`. Several processes may share the folder (`omnifabric edge --processes
N`, or edges on one host given the same DIR): each change is a read-modify-write of the
registry under an exclusive lock on `DIR/.lock` (flock), written atomically, and every read
takes the registry again when the file changed since this process last saw it. Edges on
other hosts have their own folder unless DIR is storage that honours flock.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import logging
import os
import threading
import uuid
import wave
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.edge.errors import InvalidPayload
from omnifabric.edge.pcm import check_voice_length, wav_to_pcm16k

log = logging.getLogger("omnifabric.edge.voices")

MAX_NAME_CHARS = 100
MAX_VOICES = 1000


@dataclass(frozen=True)
class Voice:
    """One registered voice, as listed."""

    id: str
    name: str
    filename: str
    duration_ms: int
    source_type: str = "upload"
    sample_rate: int = 16000
    created_at: str = ""


class VoiceRegistry:
    """The voices stored under one folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        self._seen: tuple[int, int, int] | None = None
        """(inode, size, mtime) of the registry file as last read or written."""
        self._refresh()

    def list(self) -> dict[str, Any]:
        """{total, ref_audios: [...]} in upload order."""
        with self._lock:
            self._refresh()
            return self._listing()

    def _listing(self) -> dict[str, Any]:
        voices = [asdict(v) for v in self._voices.values()]
        return {"total": len(voices), "ref_audios": voices}

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """A change of the registry: this process's lock, then the folder's (other
        processes), the registry as it is on disk now, and the change saved at the end."""
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    self._refresh()
                    yield
                    self._save()
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)

    def upload(self, name: Any, audio_base64: Any) -> Voice:
        """Store a voice; InvalidPayload (the message says what is wrong) for a bad one."""
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
            raise InvalidPayload(f"name must be text of 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(audio_base64, str) or not audio_base64:
            raise InvalidPayload("audio_base64 must be a base64 WAV")
        try:
            data = base64.b64decode(audio_base64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidPayload("audio_base64 is not valid base64") from None
        wav = wav_to_pcm16k(data, "audio_base64")
        pcm = np.frombuffer(check_voice_length(wav, "audio_base64"), "<f4")
        with self._changing():
            if len(self._voices) >= MAX_VOICES:
                raise InvalidPayload(f"{MAX_VOICES} voices are stored: delete one first")
            voice_id = str(uuid.uuid4())
            voice = Voice(
                id=voice_id,
                name=name.strip(),
                filename=f"{voice_id}.wav",
                duration_ms=int(pcm.size / 16),
                created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            )
            _write_wav(self.root / voice.filename, pcm)
            self._voices[voice_id] = voice
        log.info("voice %s stored: %r, %d ms", voice_id, voice.name, voice.duration_ms)
        return voice

    def delete(self, voice_id: str) -> bool:
        """Remove a voice; False when there is none with that id."""
        with self._changing():
            voice = self._voices.pop(voice_id, None)
            if voice is not None:
                (self.root / voice.filename).unlink(missing_ok=True)
        return voice is not None

    def pcm(self, voice_id: str) -> bytes | None:
        """A voice's audio as float32 16 kHz PCM (what sessions send as reference audio)."""
        with self._lock:
            self._refresh()
            voice = self._voices.get(voice_id)
        if voice is None:
            return None
        try:
            return wav_to_pcm16k((self.root / voice.filename).read_bytes(), "voice")
        except (OSError, InvalidPayload) as exc:
            log.error("voice %s unreadable: %s", voice_id, exc)
            return None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = (self.root / "registry.json").stat()
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _refresh(self) -> None:
        """Take the registry from disk when it changed since this process last saw it (an
        unreadable one keeps what was known, with an error logged)."""
        stamp = self._stamp()
        if stamp == self._seen:
            return
        index = self.root / "registry.json"
        voices: dict[str, Voice] = {}
        if stamp is not None:
            try:
                for entry in json.loads(index.read_text())["ref_audios"]:
                    voice = Voice(**entry)
                    if (self.root / voice.filename).is_file():
                        voices[voice.id] = voice
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("voice registry %s unreadable, keeping what was known: %s", index, exc)
                return
        self._voices = voices
        self._seen = stamp

    def _save(self) -> None:
        index = self.root / "registry.json"
        tmp = index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._listing(), ensure_ascii=False, indent=1))
        os.replace(tmp, index)
        self._seen = self._stamp()


def _write_wav(path: Path, pcm: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp")
    with wave.open(str(tmp), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    os.replace(tmp, path)
