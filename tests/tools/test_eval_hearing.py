"""The recognizer-only evaluation's plan, audio and scoring (the recognizers themselves are
tested in tests/worker/reference/)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from omnifabric.tools.eval_hearing import (
    PROBES,
    VOICES,
    Heard,
    Probe,
    cached_audio,
    main,
    plan,
    score,
    table,
    utterance_audio,
)
from omnifabric.tools.eval_reference import RATE, words_of
from omnifabric.worker.engines.vad import UtteranceRules


def test_every_key_word_is_in_its_probe():
    assert len(PROBES) >= 40
    for probe in PROBES:
        said = set(words_of(probe.text))
        assert probe.keys and all(set(k.split("|")) & said for k in probe.keys), probe


def test_plan_says_every_probe_in_every_voice():
    runs = plan(["piper", "espeak"], PROBES[:4])
    assert len(runs) == 4 * (len(VOICES["piper"]) + len(VOICES["espeak"]))
    assert len(VOICES["espeak"]) >= 6
    assert {(kind, voice, rate) for _, kind, voice, rate, _, _ in runs} == {
        (kind, voice, float(rate)) for kind in VOICES for voice, rate in VOICES[kind]
    }
    for kind in VOICES:  # each utterance of a kind has noise of its own
        seeds = [seed for _, k, *_, seed in runs if k == kind]
        assert len(set(seeds)) == len(seeds)
    assert runs == plan(["piper", "espeak"], PROBES[:4])


def test_scores_key_words_and_word_errors():
    probe = Probe("Has my order 55501 shipped yet?", ("55501", "shipped"))
    assert score(probe, "Has my order 55,501 shipped yet?") == (2, 0.0)
    kept, wer = score(probe, "As my order 55,500 one shipped yet.")
    assert kept == 1 and wer == pytest.approx(3 / 6)
    assert score(Probe("What color is it?", ("color|colour",)), "What colour is it")[0] == 1


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_audio_is_cut_as_the_turn_tracker_cuts_it(tmp_path):
    spec = (PROBES[4], "espeak", "en-us", 165.0, 1.1, 7)
    audio = utterance_audio(spec)
    rules = UtteranceRules()
    # Speech of the probe plus the tracker's pre-roll and tail, not the lead-in.
    assert 0.8 < audio.size / RATE < 1.1 + 2.0
    head = audio[: int(rules.pre_roll_s * RATE) - 80]
    assert 0 < np.abs(head).max() < 0.02  # the evaluation's low noise, no speech
    assert np.abs(audio).max() > 0.1
    again = cached_audio(spec, tmp_path)
    assert np.array_equal(again, audio) and len(list(tmp_path.iterdir())) == 1
    assert np.array_equal(cached_audio(spec, tmp_path), audio)


def test_table_has_a_row_per_voice_kind():
    results = [
        Heard("piper", "joe", 1.0, "a b", "a b", 2, 2, 0.0, 100.0, -0.2),
        Heard("espeak", "en-us", 165, "a b", "a c", 1, 2, 0.5, 300.0, -0.9),
        Heard("espeak", "en-us", 165, "a b", "a b", 2, 2, 0.0, 300.0, -1.3),
        Heard("espeak", "en-us", 165, "a b", "a d", 1, 2, 0.5, 300.0, -1.0),
    ]
    text = table(results, repair_below=-1.0)
    assert "| piper | 1 | 1/1 (100.0%) | 2/2 (100.0%) | 0.0% | 1 / 0 / 0 | 100 / 100 |" in text
    # Heard right but too unsure is asked again; a confidence at the threshold is answered.
    assert "| espeak | 3 | 1/3 (33.3%) | 4/6 (66.7%) | 33.3% | 0 / 2 / 1 | 300 / 300 |" in text
    assert "| all | 4 | 2/4 (50.0%) | 6/8 (75.0%) | 25.0% | 1 / 2 / 1 |" in text


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_the_tool_hears_with_the_engines_recognizers(tmp_path, capsys):
    from omnifabric.worker.engines.reference import moonshine
    from omnifabric.worker.engines.reference.asr import model_installed

    if not (model_installed("base") and moonshine.model_installed()):
        pytest.skip("Whisper base or Moonshine weights not installed")
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed")
    out = tmp_path / "out"
    argv = ["--voices", "espeak", "--limit", "1", "--cache", str(tmp_path / "c")]
    assert main([*argv, "--out", str(out), "--context", "France"]) == 0
    printed = capsys.readouterr().out
    assert "asr both, context 'France', load average" in printed
    assert "| espeak | 6 |" in printed and "| all | 6 |" in printed
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 6 and all(r["text"] == PROBES[0].text for r in rows)
    assert sum(r["keys_kept"] == r["keys"] for r in rows) >= 4  # the capital of France
    assert all(r["ms"] > 0 and r["confidence"] < 0 for r in rows)
