"""The scoring of `omnifabric eval` (the whole tool runs in tests/e2e/test_reference.py)."""

from __future__ import annotations

import pytest

from omnifabric.tools.eval_outcome import Outcome, playback_gaps
from omnifabric.tools.eval_reference import (
    ITEMS,
    VOICES,
    names_answer,
    plan,
    read_items,
    table,
    wer,
    words_of,
)


def test_words_spell_digits_and_drop_punctuation():
    assert words_of("It's 7, not 10!") == ["it's", "seven", "not", "ten"]
    # How Whisper tiny.en wrote "A triangle has three sides." spoken by Piper.
    assert words_of("I triangle S3 sides.") == ["i", "triangle", "s", "three", "sides"]
    assert words_of("Order 55,501 has 1,000,000 items") == [
        "order",
        "55501",
        "has",
        "1000000",
        "items",
    ]
    assert words_of("7,10 and 1,2345") == ["seven", "ten", "and", "one", "2345"]


def test_wer_counts_edits_per_reference_word():
    assert wer("What is the capital of France?", "what is the capital of france") == 0.0
    assert wer("What do bees make?", "What do these make?") == 0.25
    assert wer("a b", "") == 1.0


def test_an_answer_is_named_in_words_or_digits():
    assert names_answer("Spiders have 8 legs.", ("eight", "8"))
    assert names_answer("Ten minus three is seven.", ("seven", "7"))
    assert not names_answer("A spider has four legs.", ("eight", "8"))


def test_plan_covers_every_voice_kind_and_lead_in():
    runs = plan(list(VOICES), ITEMS, repeat=2)
    assert len(runs) == 2 * 2 * len(ITEMS)
    assert {r[1] for r in runs} == set(VOICES)
    assert {r[4] for r in runs} == {0.3, 0.7, 1.1, 1.5}


def test_table_has_a_row_per_kind_and_one_for_all():
    right = Outcome(
        "piper",
        "joe",
        1.0,
        0.3,
        "q",
        correct=True,
        question_wer=0.0,
        first_audio_s=1.2,
        unit_rtt_ms=[50.0, 900.0],
        reply_text="Paris.",
        words=1,
        queue_wait_s=0.1,
    )
    wrong = Outcome(
        "espeak",
        "en-us",
        160,
        0.7,
        "q",
        question_wer=0.5,
        sentences=4,
        loops=True,
        unit_rtt_ms=[60.0, 1200.0],
        gap_s=0.3,
        queued=True,
        queue_wait_s=17.2,
    )
    text = table([right, wrong])
    assert "| 0 | 0, 0.1 |" in text  # piper: no late unit, nobody queued
    assert "| 1 | 1, 17.2 |" in text  # espeak: one unit over 1 s, its caller waited
    assert "| 0, 0.00 |" in text and "| 1, 0.30 |" in text
    assert "| piper | 1 | 1/1 (100%) | 0% |" in text
    assert "| espeak | 1 | 0/1 (0%) | 50% |" in text
    assert "| all | 2 | 1/2 (50%) | 25% |" in text


def test_playback_gaps_are_the_silences_a_client_hears_inside_a_reply():
    # 0.6 s played from t=10; the next chunk comes at 11.0: 0.4 s of silence, then on time.
    assert playback_gaps([(10.0, 0.6), (11.0, 1.0), (11.5, 1.0)]) == [pytest.approx(0.4)]
    # Chunks that arrive while the one before still plays are queued: no gap.
    assert playback_gaps([(10.0, 1.0), (10.9, 1.0), (11.95, 0.5)]) == []
    # Units without audio do not count.
    assert playback_gaps([(10.0, 0.5), (10.4, 0.0), (11.0, 0.5)]) == [pytest.approx(0.5)]


def test_own_questions_are_read_from_a_file():
    items = read_items(
        "# capitals\n\nWhat is the capital of Italy? | Rome\n"
        "My name is Anna. / What is my name? | anna, ana\n"
    )
    assert items[0].turns == ("What is the capital of Italy?",) and items[0].expect == ("rome",)
    assert items[1].turns == ("My name is Anna.", "What is my name?")
    assert items[1].expect == ("anna", "ana")
    with pytest.raises(ValueError, match="line 2: expected"):
        read_items("What is two plus two? | four\nWhat is three plus three?\n")
    with pytest.raises(ValueError, match="no questions"):
        read_items("# nothing here\n")


def test_a_bad_questions_file_is_a_usage_error(tmp_path, capsys):
    from omnifabric.tools.eval_reference import main

    bad = tmp_path / "q.txt"
    bad.write_text("What is two plus two?\n")
    with pytest.raises(SystemExit) as stop:
        main(["--questions", str(bad), "--url", "ws://127.0.0.1:9/v1/realtime"])
    assert stop.value.code == 2
    assert "line 1: expected" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--questions", str(tmp_path / "missing.txt")])
    assert "missing.txt" in capsys.readouterr().err


def test_openai_url_names_a_model():
    from omnifabric.tools.eval_openai import openai_url

    assert openai_url("ws://h:1/v1/realtime") == "ws://h:1/v1/realtime?model=eval"
    assert openai_url("ws://h:1/v1/realtime?model=m") == "ws://h:1/v1/realtime?model=m"


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_the_openai_dialect_asks_and_scores_like_the_current_one(tmp_path):
    """`ask(..., dialect="openai")` against a synthetic stack: the question streamed as
    24 kHz PCM16 in real time with server VAD, the reply (the synthetic engine's tone and
    "reply 1 part N") collected from the response's events, timed and scored."""
    import asyncio

    import numpy as np

    from omnifabric.tools.eval_reference import Item, ask
    from tests.conftest import scaled
    from tests.stack import Stack

    heard: list[np.ndarray] = []

    def hearer(audio: np.ndarray) -> str:
        heard.append(audio)
        return "a tone"

    item = Item(("What is two plus two?",), ("tone",))
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "1", "--compute-ms", "5")
        stack.start_edge()
        question = ask(stack.url, item, "espeak", "en-us", 165, 0.3, 1, 10, hearer, "openai")
        out = asyncio.run(asyncio.wait_for(question, scaled(60)))
    finally:
        stack.stop()
    assert not out.error, out
    assert out.correct and out.reply_heard == "a tone"
    assert out.reply_text.startswith("reply 1 part 1"), out.reply_text
    assert out.first_audio_s is not None and 0 < out.first_audio_s < scaled(5), out
    assert out.reply_chunks and out.unit_rtt_ms == []
    # 16 kHz for the recognizer: the synthetic reply is 2.25 s (0.75 + 1 + 0.5 s).
    assert heard and heard[0].size > 16000, [a.size for a in heard]


def test_questions_reach_the_openai_dialect_as_24_khz_pcm16():
    import numpy as np

    from omnifabric.tools.eval_openai import pcm16_24k

    tone16 = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert len(pcm16_24k(tone16, 16000)) == 2 * 24000  # converted: 1 s at 24 kHz
    wide = np.full(24000, 0.25)
    pcm = np.frombuffer(pcm16_24k(wide, 24000), "<i2")
    assert pcm.size == 24000 and (pcm == round(0.25 * 32767)).all()  # as it is
    with pytest.raises(ValueError, match="16 or 24 kHz"):
        pcm16_24k(wide, 22050)


def test_wideband_is_for_piper_through_the_openai_dialect(capsys):
    from omnifabric.tools.eval_reference import main

    url = ["--url", "ws://127.0.0.1:9/v1/realtime"]
    for argv in (["--wideband", "--voices", "piper"], ["--wideband", "--dialect", "openai"]):
        with pytest.raises(SystemExit) as stop:
            main([*url, *argv])
        assert stop.value.code == 2
        assert "--wideband needs --dialect openai and --voices piper" in capsys.readouterr().err
