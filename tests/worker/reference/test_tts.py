"""espeak-ng speech out and the splitting of reply text into speakable pieces."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engines.reference.tts import Speaker, split_for_speech


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
