"""Drive a reference engine session directly over a fixture, unit by unit (no fabric)."""

from __future__ import annotations

import time
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnifabric.worker.engine import DuplexSettings, GenerateResult

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "speech"


def load_fixture(name: str) -> np.ndarray:
    """A committed 16 kHz fixture as float32."""
    with wave.open(str(FIXTURES / f"{name}.wav")) as w:
        assert w.getframerate() == 16000
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def units_of(audio: np.ndarray) -> list[np.ndarray]:
    """1 s units; the last one padded with silence."""
    out = []
    for start in range(0, audio.size, 16000):
        unit = audio[start : start + 16000]
        out.append(np.pad(unit, (0, 16000 - unit.size)))
    return out


@dataclass
class Step:
    seq: int
    result: GenerateResult
    compute_ms: float
    finalized: dict[str, float]
    """What the unit's finalize spent, by part (ms)."""
    early: bool = False
    """A result unit ``seq``'s finalize handed to the session's early_sink (after that
    unit's own result)."""

    @property
    def kind(self) -> str:
        if self.result.is_listen:
            kind = "L*" if self.result.end_of_turn else "L"
        else:
            kind = "S*" if self.result.end_of_turn else "S"
        return "+" + kind if self.early else kind


def drive(
    engine,
    name: str,
    force_listen_at: frozenset[int] = frozenset(),
    prompt: str = "",
    settings: DuplexSettings | None = None,
    early: bool = False,
) -> list[Step]:
    """Run a whole fixture through one session; returns one Step per unit."""
    return drive_audio(engine, load_fixture(name), name, force_listen_at, prompt, settings, early)


def drive_audio(
    engine,
    audio: np.ndarray,
    name: str = "audio",
    force_listen_at: frozenset[int] = frozenset(),
    prompt: str = "",
    settings: DuplexSettings | None = None,
    early: bool = False,
    units: list[np.ndarray] | None = None,
    speech_cuts: bool = False,
) -> list[Step]:
    """Run 16 kHz ``audio`` through one session in 1 s units (or the given ``units``);
    returns one Step per unit, and with ``early`` (the session takes results between units:
    EngineSession.early_sink) one more after a unit for each result its finalize sent.
    ``speech_cuts``: the session is told its units are cut where speech stops
    (EngineSession.speech_cuts)."""
    session = engine.open_session(f"test-{name}", "audio")
    session.speech_cuts = speech_cuts
    steps = []
    sent: list[GenerateResult] = []
    if early:
        session.early_sink = sent.append
    try:
        session.prepare(prompt, None, None, settings or DuplexSettings())
        for seq, unit in enumerate(units_of(audio) if units is None else units, start=1):
            t0 = time.perf_counter()
            session.prefill(unit, [], 1)
            result = session.generate(seq in force_listen_at)
            session.finalize()
            took = (time.perf_counter() - t0) * 1000.0
            steps.append(Step(seq, result, took, dict(session.finalize_costs)))
            steps += [Step(seq, r, 0.0, {}, early=True) for r in sent]
            sent.clear()
    finally:
        session.stop()
        session.close()
    return steps


def timeline(steps: list[Step]) -> str:
    """Compact listen/speak timeline: L listen, S speak, * end of turn."""
    return " ".join(s.kind for s in steps)
