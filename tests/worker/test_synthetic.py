"""The synthetic engine: deterministic turn taking, audio shape and context accounting."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.engine import DuplexSettings
from omnifabric.worker.engines import memory
from omnifabric.worker.engines.registry import load_engine
from omnifabric.worker.engines.synthetic import SyntheticEngine
from omnifabric.worker.errors import EngineUnavailable

SPEECH = (0.3 * np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)).astype(np.float32)
SILENCE = np.zeros(16000, dtype=np.float32)


def run(units, force=(), settings=None, prompt="", engine=None):
    """Feed units (arrays) through one session; returns the GenerateResults."""
    engine = engine or SyntheticEngine(compute_ms=0)
    session = engine.open_session("s", "audio")
    session.prepare(prompt, None, None, settings or DuplexSettings())
    results = []
    for i, pcm in enumerate(units):
        session.prefill(pcm, [], 1)
        results.append(session.generate(i in force))
        session.finalize()
    session.stop()
    session.close()
    return results


def summary(results):
    return [("L" if r.is_listen else "S") + ("." if r.end_of_turn else "") for r in results]


def test_same_input_gives_identical_output():
    units = [SPEECH] * 4 + [SILENCE] * 5 + [SPEECH, SILENCE, SILENCE]
    a, b = run(units), run(units)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.is_listen, x.text, x.end_of_turn, x.kv_cache_length) == (
            y.is_listen,
            y.text,
            y.end_of_turn,
            y.kv_cache_length,
        )
        assert np.array_equal(x.audio, y.audio)


def test_startup_protection_listens_even_after_speech_then_silence():
    results = run([SPEECH, SILENCE, SILENCE])
    assert summary(results) == ["L", "L", "L"]


def test_speech_then_silence_gives_a_reply_with_end_of_turn():
    results = run([SILENCE] * 3 + [SPEECH, SPEECH, SILENCE, SILENCE, SILENCE, SILENCE])
    assert summary(results) == ["L", "L", "L", "L", "L", "S", "S", "S.", "L"]
    reply = results[5:8]
    assert [r.text for r in reply] == ["reply 1 part 1 ", "reply 1 part 2 ", "reply 1 part 3 "]
    assert all(len(r.text) <= 28 for r in reply)
    assert reply[1].audio.size == 24000
    assert 0 < reply[0].audio.size <= 24000 and 0 < reply[2].audio.size <= 24000
    assert all(r.audio.dtype == np.float32 for r in reply)
    assert all(r.audio.size == 0 for r in results if r.is_listen)
    assert all(r.n_tokens > 0 and r.n_tts_tokens > 0 for r in reply)


def test_force_listen_closes_the_turn_at_once():
    units = [SILENCE] * 3 + [SPEECH, SILENCE, SILENCE, SILENCE]
    results = run(units, force={5})
    assert summary(results) == ["L", "L", "L", "L", "S", "L.", "L"]


def test_barge_in_closes_the_turn_and_starts_a_new_one():
    units = [SILENCE] * 3 + [SPEECH, SILENCE, SPEECH, SILENCE, SILENCE, SILENCE, SILENCE]
    results = run(units)
    assert summary(results) == ["L", "L", "L", "L", "S", "L.", "S", "S", "S.", "L"]
    assert results[6].text.startswith("reply 2 ")


def test_context_accounting():
    prompt = "x" * 40
    units = [SILENCE] * 3 + [SPEECH, SILENCE, SILENCE, SILENCE]
    engine = SyntheticEngine(compute_ms=0)
    session = engine.open_session("s", "audio")
    assert session.prepare(prompt, None, None, DuplexSettings()) == 13 + 10
    results = run(units, prompt=prompt)
    expected, kv = [], 23
    for r in results:
        kv += 13 if r.is_listen else 20
        expected.append(kv)
    assert [r.kv_cache_length for r in results] == expected
    assert all(r.input_audio_tokens == 10 for r in results)


def test_tts_disabled_gives_text_only():
    results = run([SILENCE] * 3 + [SPEECH, SILENCE], settings=DuplexSettings(tts_enabled=False))
    assert results[-1].text and results[-1].audio.size == 0 and results[-1].n_tts_tokens == 0


def test_prefill_before_finalize_is_refused_like_the_real_model():
    session = SyntheticEngine(compute_ms=0).open_session("s", "audio")
    session.prepare("", None, None, DuplexSettings())
    session.prefill(SILENCE, [], 1)
    session.generate(False)
    with pytest.raises(RuntimeError):
        session.prefill(SILENCE, [], 1)


def test_warmup_runs_one_unit():
    result = SyntheticEngine(compute_ms=0).warmup()
    assert result.is_listen and result.kv_cache_length == 26


def test_load_engine_by_name():
    engine = load_engine("synthetic", WorkerConfig(slots=3, synthetic_compute_ms=1))
    assert (engine.name, engine.default_slots, engine.concurrency) == ("synthetic", 3, 3)
    assert load_engine("synthetic", WorkerConfig()).default_slots == 4
    with pytest.raises(EngineUnavailable, match="--model-dir"):
        load_engine("minicpmo", WorkerConfig())
    with pytest.raises(EngineUnavailable):
        load_engine("nope", WorkerConfig())


def test_memory_cleanup_reports_without_importing_torch():
    had_torch = "torch" in sys.modules
    report = memory.cleanup()
    assert report.before_bytes > 0 and report.after_bytes > 0
    assert report.device in ("cpu", "cuda")
    assert ("torch" in sys.modules) == had_torch


def test_voice_activity_settings_are_noted_as_unused():
    engine = SyntheticEngine(compute_ms=0)
    session = engine.open_session("s", "audio")
    session.prepare("", None, None, DuplexSettings(vad_threshold=0.8, min_speech_ms=100))
    (note,) = session.notes
    assert note.startswith("vad_threshold, min_speech_ms: not used")
    session.prepare("", None, None, DuplexSettings(temperature=0.5))
    assert session.notes == ()
