"""Speech out (espeak-ng, and a Piper voice run as a child process), the choice between
them, and the splitting of reply text into speakable pieces."""

from __future__ import annotations

import re

import numpy as np
import pytest
from scipy.signal import resample_poly

from omnifabric.worker.engines.reference import piper
from omnifabric.worker.engines.reference.tts import (
    ESPEAK_VOICE,
    PiperSpeaker,
    Speaker,
    make_speaker,
    split_for_speech,
    voices,
)

PIPER_REASON = piper.unavailable_reason()
needs_piper = pytest.mark.skipif(
    PIPER_REASON is not None, reason=f"Piper unavailable: {PIPER_REASON}"
)


@pytest.fixture(scope="module")
def speaker() -> Speaker:
    return Speaker()


def test_sentence_gives_24khz_speech(speaker: Speaker) -> None:
    audio = speaker.synthesize("The capital of France is Paris.")
    assert Speaker.OUTPUT_RATE == 24000
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 0.5 < audio.size / Speaker.OUTPUT_RATE < 5.0
    assert 0.1 < np.abs(audio).max() <= 1.0
    # Silence beyond ~50 ms is trimmed at both ends.
    edge = int(0.1 * Speaker.OUTPUT_RATE)
    assert np.abs(audio[:edge]).max() > 0.01 and np.abs(audio[-edge:]).max() > 0.01


def test_longer_text_gives_longer_speech(speaker: Speaker) -> None:
    short = speaker.synthesize("Hello.")
    longer = speaker.synthesize("Hello, how are you doing today?")
    assert short.size < longer.size


def test_synthesis_is_deterministic(speaker: Speaker) -> None:
    assert np.array_equal(speaker.synthesize("Hello there."), speaker.synthesize("Hello there."))


def test_blank_text_gives_no_audio(speaker: Speaker) -> None:
    for text in ("", "   ", "\n"):
        audio = speaker.synthesize(text)
        assert audio.dtype == np.float32 and audio.size == 0


def test_text_that_looks_like_options_is_spoken(speaker: Speaker) -> None:
    # Passed after "--": "-s 900" is read out, not taken as a speaking rate.
    assert speaker.synthesize("-s 900 hello").size > speaker.synthesize("hello").size


def test_missing_executable_names_the_package() -> None:
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng"):
        Speaker(executable="/nonexistent/espeak-ng")


def test_failure_is_reported() -> None:
    with pytest.raises(RuntimeError, match="espeak-ng failed \\(exit 1\\)"):
        Speaker(executable="false").synthesize("Hello.")
    with pytest.raises(RuntimeError, match="did not produce a WAV"):
        Speaker(executable="echo").synthesize("Hello.")


@pytest.fixture(scope="module")
def piper_speaker() -> PiperSpeaker:
    return PiperSpeaker(start=True)


@pytest.fixture(scope="module")
def hear():
    """The project's recognizer: 24 kHz speech -> lower-case words."""
    from omnifabric.worker.engines.reference.asr import Transcriber

    try:
        asr = Transcriber()
    except FileNotFoundError:  # the default model's packages are not installed here
        asr = Transcriber(model="tiny.en")

    def words(audio24k: np.ndarray) -> list[str]:
        text = asr.transcribe(resample_poly(audio24k, 2, 3).astype(np.float32))
        return re.findall(r"[a-z']+", text.lower())

    return words


@needs_piper
def test_piper_sentence_gives_24khz_speech(piper_speaker: PiperSpeaker) -> None:
    audio = piper_speaker.synthesize("The capital of France is Paris.")
    assert PiperSpeaker.OUTPUT_RATE == 24000 and piper_speaker.rate == 22050
    assert piper_speaker.voice_name == "en_US-joe-medium"
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 1.0 < audio.size / 24000 < 4.0
    assert 0.1 < np.abs(audio).max() <= 1.0
    edge = int(0.1 * 24000)
    assert np.abs(audio[:edge]).max() > 0.01 and np.abs(audio[-edge:]).max() > 0.01


@needs_piper
def test_piper_speech_is_deterministic_and_blank_is_silent(piper_speaker: PiperSpeaker) -> None:
    short = piper_speaker.synthesize("Hello.")
    assert np.array_equal(short, piper_speaker.synthesize("Hello."))
    assert short.size < piper_speaker.synthesize("Hello, how are you doing today?").size
    for text in ("", "   ", "\n", "..."):
        audio = piper_speaker.synthesize(text)
        assert audio.dtype == np.float32 and audio.size == 0


@needs_piper
def test_recognizer_hears_the_piper_voice(piper_speaker: PiperSpeaker, hear) -> None:
    heard = hear(piper_speaker.synthesize("Please turn off the lights when you leave the room."))
    assert {"turn", "lights", "leave", "room"} <= set(heard), heard


def test_recognizer_hears_espeak(speaker: Speaker, hear) -> None:
    heard = hear(speaker.synthesize("Please turn off the lights when you leave the room."))
    assert {"turn", "lights", "leave", "room"} <= set(heard), heard


def test_espeak_is_chosen_when_asked() -> None:
    for choice in (make_speaker("espeak"), make_speaker("piper", voice=ESPEAK_VOICE)):
        assert isinstance(choice.speaker, Speaker) and choice.reason is None
    with pytest.raises(ValueError):
        make_speaker("festival")


def test_falls_back_to_espeak_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(piper, "piper_version", lambda: None)
    speaker, reason = make_speaker("piper")
    assert isinstance(speaker, Speaker)
    assert reason is not None and "pip install piper-tts" in reason and "espeak-ng" in reason
    speaker, reason = make_speaker("piper", voice="en_US-joe-medium")
    assert isinstance(speaker, Speaker) and "'en_US-joe-medium' needs Piper" in reason
    assert voices() == {ESPEAK_VOICE: "espeak"}


@needs_piper
def test_requested_piper_voice_is_honoured_or_explained() -> None:
    assert voices() == {"en_US-joe-medium": "piper", ESPEAK_VOICE: "espeak"}
    for name in (None, "joe", "en_US-joe-medium"):
        speaker, reason = make_speaker("piper", voice=name)
        assert isinstance(speaker, PiperSpeaker) and reason is None
        assert speaker.voice_name == "en_US-joe-medium"
    speaker, reason = make_speaker("piper", voice="nobody")
    assert isinstance(speaker, PiperSpeaker)
    assert "'nobody'" in reason and "speaking with en_US-joe-medium" in reason
    speaker, reason = make_speaker("espeak", voice="nobody")
    assert isinstance(speaker, Speaker) and "'nobody'" in reason


@needs_piper
def test_same_voice_shares_one_child() -> None:
    first, second = PiperSpeaker(), PiperSpeaker(voice="joe")
    assert first.process is second.process
    assert PiperSpeaker(length_scale=1.3).process is not first.process


@pytest.mark.parametrize(
    ("text", "piece", "rest"),
    [
        ("The capital of France is Paris.", "The capital of", "France is Paris."),
        ("Hello there, world", "Hello there, world", ""),  # exactly 18: fits whole
        ("Hello there, world and more", "Hello there, world", "and more"),  # space at 18
        ("Short.", "Short.", ""),
        ("Supercalifragilisticexpialidocious!", "Supercalifragilist", "icexpialidocious!"),
        ("   Leading spaces are dropped here", "Leading spaces are", "dropped here"),
        ("Paris.\n\nIn Japanese it is", "Paris.\n\nIn", "Japanese it is"),
        ("", "", ""),
        ("   ", "", ""),
    ],
)
def test_split_for_speech(text: str, piece: str, rest: str) -> None:
    assert split_for_speech(text) == (piece, rest)
    assert len(piece) <= 18


def test_split_for_speech_other_width() -> None:
    assert split_for_speech("one two three", max_chars=7) == ("one two", "three")
    assert split_for_speech("abcdef", max_chars=4) == ("abcd", "ef")
    with pytest.raises(ValueError):
        split_for_speech("x", max_chars=0)
