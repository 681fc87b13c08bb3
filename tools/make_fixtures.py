"""Render the deterministic test speech: espeak-ng utterances composed into 16 kHz WAVs.

    python -m omnifabric.tools.make_fixtures [--out tests/fixtures/speech]

espeak-ng renders fixed text bit-identically; silences get seeded low noise (sigma 0.002)
so they are not digital zero. The WAVs are committed; rerun this after changing a scenario.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np

RATE = 16000
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "speech"

#: Each scenario: a list of (kind, value[, voice]); "silence" values are seconds.
SCENARIOS: dict[str, list[tuple]] = {
    # One question after the startup units, then room for the reply.
    "question": [
        ("silence", 3.0),
        ("say", "What is the capital of France?", "en-us"),
        ("silence", 9.0),
    ],
    # Two questions with a gap long enough for the first reply.
    "two_questions": [
        ("silence", 3.0),
        ("say", "What is the capital of France?", "en-us"),
        ("silence", 9.0),
        ("say", "What color is the sky?", "en-us"),
        ("silence", 9.0),
    ],
    # A second voice talks over the reply (barge-in), then asks something else.
    "barge_in": [
        ("silence", 3.0),
        ("say", "What is the capital of France?", "en-us"),
        ("silence", 1.2),
        ("say", "Stop. Tell me about dogs instead.", "en-us+f3"),
        ("silence", 9.0),
    ],
}


def espeak(text: str, voice: str, rate_wpm: int = 160) -> np.ndarray:
    """espeak-ng speech at 16 kHz float32 (rendered at 22050 Hz, resampled)."""
    from scipy.signal import resample_poly

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit("espeak-ng not found: apt-get install espeak-ng")
    wav = subprocess.run(
        [exe, "-v", voice, "-s", str(rate_wpm), "--stdout", "--", text],
        check=True,
        capture_output=True,
        timeout=30,
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        assert w.getframerate() == 22050 and w.getsampwidth() == 2
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float64) / 32768.0
    return resample_poly(pcm, 320, 441).astype(np.float32)


def compose(parts: list[tuple], seed: int) -> np.ndarray:
    """Concatenate the parts; add seeded low noise everywhere."""
    pieces = []
    for part in parts:
        if part[0] == "silence":
            pieces.append(np.zeros(int(part[1] * RATE), np.float32))
        else:
            pieces.append(espeak(part[1], part[2]))
    audio = np.concatenate(pieces)
    noise = np.random.default_rng(seed).normal(0.0, 0.002, audio.size).astype(np.float32)
    return np.clip(audio + noise, -1.0, 1.0)


def write_wav(path: Path, audio: np.ndarray) -> None:
    pcm = np.round(audio * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (name, parts) in enumerate(sorted(SCENARIOS.items())):
        audio = compose(parts, seed=1000 + i)
        write_wav(args.out / f"{name}.wav", audio)
        print(f"{name}.wav: {audio.size / RATE:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
