"""The closer hearing of a whole clip (a request that arrives as one input_audio item): beam
search in both recognizers, every reading scored by both (asr.beam_search,
Transcriber/Moonshine.candidates, Ears/Transcriber.hear_closely)."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import torch
from scipy.io import wavfile
from scipy.signal import resample_poly

from omnifabric.worker.engines.reference import moonshine
from omnifabric.worker.engines.reference.asr import (
    Hypothesis,
    Transcriber,
    beam_search,
    model_installed,
)
from omnifabric.worker.engines.reference.hearing import Ears

ESPEAK = "/usr/bin/espeak-ng"
needs_models = pytest.mark.skipif(
    not moonshine.model_installed() or not model_installed("base"),
    reason="Moonshine (moonshine-cpp) or Whisper base weights not installed",
)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def rows(*probabilities: dict[int, float]) -> torch.Tensor:
    """Log-probability rows over a 4-token vocabulary (token 0 ends), from probabilities."""
    out = torch.full((len(probabilities), 4), float("-inf"))
    for i, row in enumerate(probabilities):
        for token, p in row.items():
            out[i, token] = float(np.log(p))
    return out


def test_beam_search_finds_the_likelier_sequence_greedy_misses() -> None:
    # Greedy takes 1 (0.6) and then has only poor ways on (0.3 each); 2 (0.4) is followed by
    # a sure 3 and the end: 0.4 > 0.6 x 0.3.
    after = {1: {3: 0.3, 2: 0.3, 0: 0.3}, 2: {3: 1.0}, 3: {0: 1.0}}
    history: list[list[int]] = [[]]

    def step(sources: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        history[:] = [
            [*history[s], t] for s, t in zip(sources.tolist(), tokens.tolist(), strict=True)
        ]
        return rows(*(after[seq[-1]] if len(seq) == 1 else {0: 1.0} for seq in history))

    found = beam_search(rows({1: 0.6, 2: 0.4})[0], step, end=0, limit=5, beams=2)
    assert found[0][0] == [2, 3]
    assert found[0][1] == pytest.approx(np.log(0.4), abs=1e-4)
    assert [seq for seq, _ in found][1][0] == 1  # the greedy path, second
    assert found[0][1] >= found[1][1]


def test_beam_search_leaves_out_what_never_ends() -> None:
    def step(sources: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return rows(*({1: 0.9, 2: 0.1} for _ in tokens))

    assert beam_search(rows({1: 1.0})[0], step, end=0, limit=4, beams=2) == []


@pytest.fixture(scope="module")
def ears() -> Ears:
    return Ears(Transcriber(model="base"), moonshine.Moonshine())


def speak(text: str, voice: str = "en-us", rate: int = 160, tmp: str = "/tmp") -> np.ndarray:
    path = f"{tmp}/hearing-closely-{voice}-{rate}.wav"
    subprocess.run([ESPEAK, "-v", voice, "-s", str(rate), "-w", path, text], check=True)
    _, pcm = wavfile.read(path)
    audio = resample_poly(pcm.astype(np.float32) / 32768.0, 320, 441).astype(np.float32)
    return np.concatenate([np.zeros(4000, np.float32), audio, np.zeros(4800, np.float32)])


@needs_models
def test_each_recognizer_offers_its_likeliest_readings(ears, tmp_path) -> None:
    said = "What's the weather in Madrid today?"
    audio = speak(said, tmp=str(tmp_path))
    enc = ears.whisper.encode(audio)
    readings = ears.whisper.candidates(enc)
    assert 1 < len(readings) <= 4 and len(set(readings)) == len(readings)
    scores = [ears.whisper.score(enc, t)[0] for t in readings]
    greedy = ears.whisper.hypothesis(enc).text
    assert scores[0] >= ears.whisper.score(enc, greedy)[0] - 1e-3  # beams find no worse
    m_enc = ears.moonshine.encode(audio)
    m_readings = ears.moonshine.candidates(m_enc)
    assert 1 < len(m_readings) <= 4
    m_scores = [ears.moonshine.score(m_enc, t)[0] for t in m_readings]
    assert m_scores == sorted(m_scores, reverse=True) or max(m_scores) - m_scores[0] < 1e-2


@needs_models
def test_hearing_closely_weighs_readings_the_greedy_transcripts_lack(
    ears, tmp_path, monkeypatch
) -> None:
    # Both greedy transcripts made wrong alike: ``hear`` has nothing else to weigh and takes
    # them; the closer hearing also weighs the beams' readings, and both models find the
    # true one likelier.
    said = "What's the weather in Paris today?"
    audio = speak(said, tmp=str(tmp_path))
    wrong = "What's the weather in Harris today?"
    for model in (ears.whisper, ears.moonshine):
        real = model.hypothesis

        def fake(*args, _real=real, **kwargs) -> Hypothesis:
            found = _real(*args, **kwargs)
            return Hypothesis(wrong, found.total, found.count, found.cross)

        monkeypatch.setattr(model, "hypothesis", fake)
    assert ears.hear(audio)[0] == wrong
    text, confidence = ears.hear_closely(audio)
    assert words(text) == words(said), text
    assert -1.5 < confidence < 0
    assert set(ears.last_timings) == {"whisper", "moonshine", "both", "scoring"}


@needs_models
def test_hearing_closely_gives_whisper_the_context_and_hears_nothing_in_silence(
    ears, tmp_path, monkeypatch
) -> None:
    seen: list[str | None] = []
    real = ears.whisper.candidates

    def spy(enc, context=None, beams=4):
        seen.append(context)
        return real(enc, context, beams)

    monkeypatch.setattr(ears.whisper, "candidates", spy)
    text, _ = ears.hear_closely(speak("Is it sunny in Rome?", tmp=str(tmp_path)), "Rome")
    assert seen == ["Rome"] and "sunny" in words(text)
    assert ears.hear_closely(np.zeros(16000, np.float32)) == ("", float("-inf"))
    said = "Can you tell me the weather for tomorrow morning?"
    alone, confidence = ears.whisper.hear_closely(speak(said, tmp=str(tmp_path)))
    assert words(alone) == words(said) and -1.0 < confidence < 0
    assert ears.whisper.hear_closely(np.zeros(16000, np.float32)) == ("", float("-inf"))


def test_a_clip_cut_at_its_speech_gets_the_margins_of_an_utterance() -> None:
    from omnifabric.worker.engines.reference.hearing import with_margins

    speech = np.full(8000, 0.5, np.float32)
    padded = with_margins(speech)
    assert padded.size == 8000 + 4000 + 4800  # 0.25 s before, 0.3 s after (UtteranceRules)
    assert np.abs(padded[:4000]).max() == 0 and np.abs(padded[-4800:]).max() == 0
    quiet = np.concatenate([np.zeros(6000, np.float32), speech, np.zeros(1600, np.float32)])
    assert with_margins(quiet).size == quiet.size + 3200  # only the tail was short
    roomy = np.concatenate([np.zeros(4000, np.float32), speech, np.zeros(4800, np.float32)])
    assert with_margins(roomy) is not None and with_margins(roomy).size == roomy.size
    silence = np.zeros(100, np.float32)
    assert with_margins(silence).size == 100


class Heard:
    """A recognizer that says which way it was asked to hear, and with what."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, str | None]] = []

    def hear(self, audio, context=None):
        self.asked.append(("hear", audio.size, context))
        return "plain", -0.1

    def hear_closely(self, audio, context=None):
        self.asked.append(("closely", audio.size, context))
        return "closely", -0.1

    def transcribe(self, audio, context=None):
        self.asked.append(("transcribe", audio.size, context))
        return "transcribed"


def test_a_whole_request_is_heard_with_margins_names_and_closely_when_it_may_call() -> None:
    from omnifabric.common.tools import NONE
    from omnifabric.worker.engine import ChatMessage, ChatTurn, ToolChoice, ToolSpec
    from omnifabric.worker.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine()  # not loaded: its recognizer is the stand-in
    ears = Heard()
    engine._asr = ears  # type: ignore[assignment]
    clip = np.full(16000, 0.3, np.float32)
    pick = ToolSpec("pick", "Pick a dish.", {"properties": {"dish": {"enum": ["Pad Thai"]}}})
    system = ChatMessage("system", ("You take orders for Luigi's Kitchen.",))
    turn = ChatTurn(messages=(system, ChatMessage("user", (clip,))), tools=(pick,))
    assert engine._request_of(turn) == "closely"
    assert ears.asked == [("closely", 16000 + 4000 + 4800, "Luigi's Kitchen, Pad Thai")]
    plain = ChatTurn(messages=turn.messages, tools=(pick,), tool_choice=ToolChoice(NONE))
    assert engine._request_of(plain) == "plain"
    assert ears.asked[-1] == ("hear", 16000 + 4000 + 4800, "Luigi's Kitchen, Pad Thai")
    earlier = ChatMessage("user", (clip,))
    assert engine._text_of(earlier) == "transcribed"  # earlier turns: heard as before
