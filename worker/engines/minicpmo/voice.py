"""The default voice of sessions that bring no reference audio (the model speaks silence
without one): a configured WAV, else the model directory's own reference audio, else a clip
the project renders with its own TTS (espeak-ng, as the reference engine speaks)."""

from __future__ import annotations

import os
import tempfile
import wave
from pathlib import Path

import numpy as np

from omnifabric.common.paths import cache_root

#: What the project's own clip says (about 4 s at 160 words per minute).
CLIP_TEXT = "Hello, I am your voice assistant. How can I help you today?"
RATE = 16000


def write_wav(pcm: np.ndarray, path: str | os.PathLike[str] | None = None, rate: int = RATE) -> str:
    """float32 PCM as a 16-bit mono WAV at `path` (a new temporary file when None);
    returns the path. The model code takes voices as file paths."""
    if path is None:
        fd, name = tempfile.mkstemp(prefix="omni-voice-", suffix=".wav")
        os.close(fd)
        path = name
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return str(path)


def read_wav(path: str | os.PathLike[str]) -> np.ndarray:
    """A 16-bit PCM WAV (any rate, mono or stereo) as float32 mono at 16 kHz."""
    from scipy.signal import resample_poly

    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported")
        rate, channels = wav.getframerate(), wav.getnchannels()
        data = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    pcm = data.reshape(-1, channels).mean(axis=1).astype(np.float32) / 32768.0
    if rate != RATE:
        g = np.gcd(rate, RATE)
        pcm = resample_poly(pcm, RATE // g, rate // g).astype(np.float32)
    return pcm


def model_dir_voice(root: Path) -> Path | None:
    """A reference voice the checkpoint carries: a WAV under assets/ outside the vocoder's
    own folder, names with "ref" first."""
    assets = root / "assets"
    if not assets.is_dir():
        return None
    wavs = sorted(
        p for p in assets.rglob("*.wav") if "token2wav" not in p.relative_to(assets).parts
    )
    wavs.sort(key=lambda p: "ref" not in p.name.lower())
    return wavs[0] if wavs else None


def project_clip(cache_dir: Path) -> Path:
    """The project's own default voice clip (espeak-ng, 16 kHz), made once into
    `cache_dir`. Raises RuntimeError when espeak-ng is missing."""
    path = cache_dir / "default-voice-espeak.wav"
    if not path.is_file():
        try:
            from scipy.signal import resample_poly

            from omnifabric.worker.engines.reference.tts import Speaker
        except ImportError as exc:
            raise RuntimeError(
                f"the project's voice clip is rendered with the reference extra ({exc}): "
                "pip install 'omnifabric[reference]', or give a voice WAV"
            ) from None

        speech = Speaker().synthesize(CLIP_TEXT)  # 24 kHz
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_wav(resample_poly(speech, 2, 3).astype(np.float32), tmp)
        tmp.replace(path)
    return path


def resolve(configured: str | None, model_root: Path | None) -> tuple[Path, str]:
    """The default voice file and where it came from ("configured", "model", "project").
    Raises RuntimeError when none can be had."""
    if configured:
        path = Path(configured)
        if not path.is_file():
            raise RuntimeError(f"default voice {path} does not exist")
        return path, "configured"
    if model_root is not None:
        found = model_dir_voice(model_root)
        if found is not None:
            return found, "model"
    return project_clip(cache_root()), "project"
