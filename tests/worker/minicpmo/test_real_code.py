"""The minicpmo engine on tiny random-weight checkpoints of the real public model code, for
every layout the configured code offers (opt-in: OMNI_MINICPMO_CODE_DIR, see conftest).

Random weights speak gibberish; what is checked is the engine's contract with the code:
loading, every setting reaching the model, accounting from the model's real numbers,
cleanup, re-chunking, and sessions on one model not seeing each other.
"""

from __future__ import annotations

import asyncio
import io
import logging
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from omnifabric.worker.engine import ChatMessage, ChatTurn, DuplexSettings
from omnifabric.worker.engines.minicpmo import MiniCPMOEngine
from omnifabric.worker.session import DuplexSession
from omnifabric.worker.session_types import CloseReason, SessionEnd, SessionLimits, SessionSpec
from omnifabric.worker.units import UnitInput
from tests.conftest import ROOT
from tests.worker.minicpmo.conftest import LAYOUTS, needs_code

pytestmark = [needs_code, pytest.mark.timeout(600)]
#: Seeded: the TTS samples whatever the text temperature (its tokens make the audio, and time a
#: half-duplex call's text pieces), so runs compared with each other start from one seed.
GREEDY = DuplexSettings(temperature=0, force_listen_count=0, seed=7)


def noise(seed: int, seconds: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.05 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def run_units(engine, settings, inputs, force=()):
    """Open a session, feed (pcm, frames) per unit on the engine directly; returns the
    results and the session (closed)."""
    s = engine.open_session("s", "audio")
    try:
        s.prepare("Be brief.", None, None, settings)
        results = []
        for i, (pcm, frames) in enumerate(inputs):
            s.prefill(pcm, frames, 1)
            results.append(s.generate(i in force))
            s.finalize()
        return results, s
    finally:
        s.close()


def test_load_logs_the_layout(tiny_dirs, caplog):
    for layout, code in LAYOUTS:
        caplog.clear()
        with caplog.at_level(logging.INFO, "omnifabric.worker.minicpmo"):
            eng = MiniCPMOEngine(str(tiny_dirs[code]), device="cpu", api=layout)
            eng.load()
        assert any(f"driving {layout_text(layout)}" in r.getMessage() for r in caplog.records)
        # The tiny checkpoint carries random vocoder assets: speech on, on CPU too.
        assert eng.audio_on is True
        assert not any("text only" in r.getMessage() for r in caplog.records)
        quiet = MiniCPMOEngine(str(tiny_dirs[code]), device="cpu", api=layout, text_only=True)
        with caplog.at_level(logging.INFO, "omnifabric.worker.minicpmo"):
            quiet.load()
        assert quiet.audio_on is False
        assert any("text only" in r.getMessage() for r in caplog.records)


def layout_text(layout: str) -> str:
    from omnifabric.worker.engines.minicpmo.layouts import DESCRIPTION

    return DESCRIPTION[layout]


def test_audio_video_session_through_the_unit_loop(engine):
    """Video units with frames of two sizes: the vision tokens reported are what the
    context grew by beyond an audio-only unit (slice grid: 1 + M*N slices of 66)."""

    async def main():
        spec = SessionSpec("v1", "l1", "video", system_prompt="Describe.", settings=GREEDY)
        session = DuplexSession(spec, engine, ThreadPoolExecutor(1), SessionLimits(300, 8192))
        await session.open()
        task = asyncio.ensure_future(session.run())
        session.submit(UnitInput(1, noise(1)))
        session.submit_later = None
        outs = []
        async for event in session.journal.events():
            outs.append(event)
            if len(outs) == 1:
                session.submit(UnitInput(2, noise(2), frames=[jpeg(64, 64)]))
            elif len(outs) == 2:
                session.submit(UnitInput(3, noise(3), frames=[jpeg(1344, 448)], max_slice_nums=9))
            elif len(outs) == 3:
                session.close(CloseReason.USER_STOP)
            if isinstance(event, SessionEnd):
                break
        await task
        return outs

    outs = asyncio.run(main())
    results = [o.result for o in outs[:3]]
    assert isinstance(outs[-1], SessionEnd) and outs[-1].reason is CloseReason.USER_STOP
    audio_only = results[0].input_audio_tokens
    assert results[0].input_vision_tokens == 0 and audio_only > 0
    assert results[1].input_vision_tokens == 66  # one slice
    assert results[2].input_vision_tokens == 66 * 4  # 1 + a 1x3 grid
    for r in results[1:]:
        assert r.input_audio_tokens == audio_only  # the rest of the growth was the image
    assert outs[-1].usage.input_vision_tokens == 66 * 5
    # Both stages' totals are kept (generate's no longer overwrites prefill's).
    costs = outs[0].timings.engine_costs_ms
    assert costs["prefill_all"] > 0 and costs["generate_all"] > 0


def test_force_listen_closes_the_turn(engine):
    results, _ = run_units(engine, GREEDY, [(noise(i), []) for i in range(4)], force={2})
    assert not results[0].is_listen  # random weights speak at once with startup listen off
    assert results[2].is_listen and results[2].text == ""
    assert results[2].audio.size == 0


def test_force_listen_count_and_no_carry_over(engine):
    results, _ = run_units(
        engine,
        DuplexSettings(temperature=0, force_listen_count=3),
        [(noise(i), []) for i in range(4)],
    )
    assert [r.is_listen for r in results[:3]] == [True, True, True]
    again, _ = run_units(engine, GREEDY, [(noise(i), []) for i in range(2)])
    assert not again[0].is_listen  # the next session does not inherit the count


def test_speak_tokens_per_unit_reach_the_model(engine):
    results, _ = run_units(
        engine,
        DuplexSettings(temperature=0, force_listen_count=0, max_new_speak_tokens_per_chunk=3),
        [(noise(i), []) for i in range(3)],
    )
    spoken = [r for r in results if not r.is_listen]
    assert spoken and all(r.n_tokens <= 3 for r in spoken)
    default, _ = run_units(engine, GREEDY, [(noise(i), []) for i in range(3)])
    assert max(r.n_tokens for r in default) > 3


def test_listen_scale_and_sampling_reach_the_model(engine):
    inputs = [(noise(i), []) for i in range(3)]
    scaled = {}
    for scale in (1e6, -1e6):  # the listen logit is multiplied by it
        results, _ = run_units(
            engine,
            DuplexSettings(temperature=0, force_listen_count=0, listen_prob_scale=scale),
            inputs,
        )
        scaled[scale] = [(r.is_listen, r.text) for r in results]
    assert scaled[1e6] != scaled[-1e6]
    a, _ = run_units(
        engine,
        DuplexSettings(temperature=5.0, top_k=1000, top_p=1.0, force_listen_count=0),
        [(noise(1), [])] * 3,
    )
    b, _ = run_units(engine, GREEDY, [(noise(1), [])] * 3)
    assert [r.text for r in a] != [r.text for r in b]


def test_system_prompt_and_reference_audio_reach_the_model(engine):
    s = engine.open_session("p", "audio")
    try:
        short = s.prepare("Hi.", None, None, GREEDY)
        s.close()
        s = engine.open_session("p", "audio")
        long = s.prepare("Hi. " * 20, None, None, GREEDY)
        s.close()
        s = engine.open_session("p", "audio")
        with_ref = s.prepare("Hi.", noise(5, 2.0), None, GREEDY)
    finally:
        s.close()
    assert long > short + 20
    assert with_ref > short  # the reference audio's embeddings are in the prompt


def test_close_frees_every_cache(engine):
    _, session = run_units(engine, GREEDY, [(noise(i), []) for i in range(3)])
    handle = session.handle
    assert handle.kv_length() == 0
    assert handle.duplex.decoder.cache is None
    model = engine.model
    assert model.audio_past_key_values is None
    assert model.processor._streaming_mel_processor is None
    assert session.shared == {}
    if engine.audio_on:  # the vocoder's caches went with the session
        d = handle.duplex
        assert getattr(d, "flow_cache_base", None) is None
        assert getattr(d, "hift_cache_base", None) is None
        assert not getattr(d, "token2wav_buffer", [])
        tok = model.tts.audio_tokenizer
        assert tok.stream_cache is None and not tok.cache
    # The next session starts from nothing of this one: same input, same output.
    first, _ = run_units(engine, GREEDY, [(noise(9), [])] * 3)
    second, _ = run_units(engine, GREEDY, [(noise(9), [])] * 3)
    assert [r.text for r in first] == [r.text for r in second]
    assert [r.kv_cache_length for r in first] == [r.kv_cache_length for r in second]


def test_sessions_of_one_voice_share_its_caches(engine):
    """The flow caches the model code keeps for a session's turns are its voice's one copy
    (vocoder.Voice) for every session of that voice; a session with a voice of its own
    keeps another; a session's own bytes leave a shared voice out."""
    from omnifabric.worker.engines.minicpmo import vocoder

    if not engine.audio_on:
        pytest.skip("the tiny checkpoint has no vocoder here")
    a, b = (engine.open_session(f"v{i}", "audio") for i in range(2))
    try:
        a.prepare("Hi.", None, None, GREEDY)
        b.prepare("Hello.", None, None, GREEDY)
        kept = a.handle.duplex.flow_cache_base
        assert isinstance(kept, vocoder.Voice)
        assert b.handle.duplex.flow_cache_base is kept
        own = engine.vocoder_cache_bytes(a)
        assert 0 < own and engine.voice_bytes() >= vocoder.cache_bytes(kept)
        b.close()
        b = engine.open_session("v2", "audio")
        b.prepare("Hello.", None, noise(3, 2.0), GREEDY)
        mine = b.handle.duplex.flow_cache_base
        assert isinstance(mine, vocoder.Voice) and mine is not kept
        assert engine.vocoder_cache_bytes(a) == own
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("seconds", [0.5, 1.0, 1.5, 3.0])
def test_unit_lengths_through_the_unit_loop(engine, seconds):
    """Client units of any length become model units of exactly 1 s (the first padded to
    1.035 s): every client unit is answered, the model sees every second of audio."""
    count = 6
    expected = int(count * seconds)  # model units in count * seconds of audio

    async def main():
        spec = SessionSpec("u", "l", "audio", settings=GREEDY)
        session = DuplexSession(spec, engine, ThreadPoolExecutor(1), SessionLimits(600, 8192))
        await session.open()
        task = asyncio.ensure_future(session.run())
        outs, sent, served = [], 1, 0
        session.submit(UnitInput(1, noise(1, seconds)))
        async for event in session.journal.events():
            outs.append(event)
            if isinstance(event, SessionEnd):
                break
            served += not event.buffered
            if event.seq == sent and sent < count:
                sent += 1  # the next client unit, once this one was taken
                session.submit(UnitInput(sent, noise(sent, seconds)))
            if served == expected:
                session.close(CloseReason.USER_STOP)
        await task
        return outs

    outs = asyncio.run(main())
    end = outs[-1]
    assert isinstance(end, SessionEnd) and end.reason is CloseReason.USER_STOP, end
    results = outs[:-1]
    assert {o.seq for o in results} == set(range(1, count + 1))  # every unit answered
    assert sum(not o.buffered for o in results) == expected == end.units_served
    assert end.units_dropped == 0
    # Each model unit adds the same audio tokens: the model got whole 1 s units.
    assert len({o.result.input_audio_tokens for o in results if not o.buffered}) == 1


def kv_fingerprint(session) -> float:
    """A sum over the session's LLM KV cache: equal caches, equal sums."""
    cache = session.handle.duplex.decoder.cache
    keys = getattr(cache, "key_cache", None)
    if keys is None:
        keys = [layer[0] for layer in cache]
    return float(sum(k.double().sum().item() for k in keys))


def step(session, pcm) -> tuple[str, int, float, bytes]:
    """One unit: its text, the cache length, the KV cache's fingerprint after it and its
    audio (24 kHz float32 bytes)."""
    session.prefill(pcm, [], 1)
    result = session.generate(False)
    session.finalize()
    audio = result.audio.tobytes() if result.audio is not None else b""
    return result.text, result.kv_cache_length, kv_fingerprint(session), audio


def interleave(engine, a_in, b_in):
    sa, sb = engine.open_session("a", "audio"), engine.open_session("b", "audio")
    out_a, out_b = [], []
    try:
        sa.prepare("Be brief.", None, None, GREEDY)
        sb.prepare("Answer in French.", None, None, GREEDY)
        for x, y in zip(a_in, b_in, strict=True):
            out_a.append(step(sa, x))
            out_b.append(step(sb, y))
    finally:
        sa.close()
        sb.close()
    return out_a, out_b


def solo(engine, prompt, inputs):
    s = engine.open_session("solo", "audio")
    try:
        s.prepare(prompt, None, None, GREEDY)
        out = [step(s, pcm) for pcm in inputs]
    finally:
        s.close()
    return out


def test_two_sessions_interleaved_match_solo(engine, monkeypatch):
    """Two sessions on one model, unit by unit in turn, give exactly what each gives alone
    (text, cache length, and the KV cache itself); without the per-session swap of the
    state kept on the shared model they do not."""
    a_in = [noise(100 + i) for i in range(4)]
    b_in = [noise(200 + i) for i in range(4)]
    solo_a = solo(engine, "Be brief.", a_in)
    solo_b = solo(engine, "Answer in French.", b_in)
    inter_a, inter_b = interleave(engine, a_in, b_in)
    assert inter_a == solo_a
    assert inter_b == solo_b

    from omnifabric.worker.engines.minicpmo.state import SharedState

    monkeypatch.setattr(SharedState, "load", lambda self, values: None)
    monkeypatch.setattr(SharedState, "save", lambda self: {})
    bad_a, _ = interleave(engine, a_in, b_in)
    assert [x[2] for x in bad_a] != [x[2] for x in solo_a]


def test_a_session_s_streaming_leaves_another_s_reference_audio_alone(engine):
    """The audio feature extractor's log-mel mode, which the streaming mel sets before each
    of its mels (a fixed floor under 5 s of buffered audio, a dynamic range past it), is a
    session's own: the next session's reference audio is heard the same whichever another
    session streamed last (it differed before the mode was swapped per session)."""
    # A voice clip with a pause in it: where the two modes' floors differ.
    reference = np.concatenate([np.zeros(8000, np.float32), 6 * noise(7, 1.0)])

    def with_reference():
        s = engine.open_session("ref", "audio")
        try:
            s.prepare("Be brief.", reference, None, GREEDY)
            return [step(s, noise(300 + i)) for i in range(2)]
        finally:
            s.close()

    def streaming(units: int) -> None:
        s = engine.open_session("streaming", "audio")
        try:
            s.prepare("Be brief.", None, None, GREEDY)
            for i in range(units):
                step(s, noise(400 + i))
        finally:
            s.close()

    streaming(7)  # its buffer passes 5 s: the dynamic range
    after_long = with_reference()
    streaming(1)  # under 5 s: the fixed floor
    after_short = with_reference()
    assert after_long == after_short


def test_a_chat_between_units_leaves_a_session_untouched(engine):
    """A chat turn on another slot, its chunks between a duplex session's units."""
    a_in = [noise(300 + i) for i in range(4)]
    alone = solo(engine, "Be brief.", a_in)
    turn = ChatTurn(messages=(ChatMessage("user", ("Hi.", noise(8))),), max_new_tokens=30)
    s = engine.open_session("a", "audio")
    chat = engine.chat(turn)
    try:
        s.prepare("Be brief.", None, None, GREEDY)
        mixed = []
        for pcm in a_in:
            next(chat, None)
            mixed.append(step(s, pcm))
    finally:
        list(chat)
        s.close()
    assert mixed == alone


@pytest.mark.parametrize("max_new_tokens", [6, 40])
def test_chat_streams_with_real_counts(engine, max_new_tokens):
    turn = ChatTurn(
        messages=(
            ChatMessage("system", ("You are terse.",)),
            ChatMessage("user", ("Name a colour.", noise(7, 1.0))),
        ),
        max_new_tokens=max_new_tokens,
        temperature=0,
    )
    chunks = list(engine.chat(turn))
    assert chunks[0].prefilled and chunks[0].input_tokens > 10
    done = chunks[-1]
    assert done.done and done.input_tokens == chunks[0].input_tokens
    text = "".join(c.text for c in chunks[1:-1])
    assert done.output_tokens > 0 and text
    assert done.output_tokens <= max_new_tokens
    if max_new_tokens == 6:
        assert done.cut and done.output_tokens == 6


def test_the_chat_path_leaves_no_voice_file_behind(engine, tmp_path, monkeypatch):
    """The model code writes the answer's voice to a temporary WAV for every chat turn and
    half-duplex call with speech (chat.init_voice removes it once read); the default voice
    is prepared once."""
    import tempfile

    if not engine.audio_on:
        pytest.skip("the tiny checkpoint has no vocoder here")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    turn = ChatTurn(messages=(ChatMessage("user", ("Hi.", noise(8))),), max_new_tokens=8)
    assert list(engine.chat(replace(turn, speech=True)))[-1].done
    # the default voice is kept: a later turn in it makes no flow pass over it again, even
    # when other voices were set in between (the vocoder holds only the last one it set)
    import gc

    engine.model.tts.audio_tokenizer.voice = None
    gc.collect()
    flow = engine.model.tts.audio_tokenizer.flow
    passes = []
    made = flow.setup_cache
    monkeypatch.setattr(flow, "setup_cache", lambda *a, **k: passes.append(1) or made(*a, **k))
    assert list(engine.chat(replace(turn, speech=True)))[-1].done
    assert passes == [] and engine.chat_voice_kept is not None
    s = engine.open_session("call", "audio")
    try:
        s.prepare("Be brief.", None, noise(4, 2.0), CALL)
        with engine.using(s):
            kept = engine.model.token2wav_cache["flow_cache_base"]
        assert kept is engine.model.tts.audio_tokenizer.voice
    finally:
        s.close()
    assert sorted(tmp_path.iterdir()) == []


# ---- half-duplex calls (the model's streaming chat path) ------------------------------------

CALL = DuplexSettings(half_duplex=True, temperature=0, seed=7)
QUESTION = ROOT / "tests" / "fixtures" / "speech" / "question.wav"


def question() -> np.ndarray:
    """The fixture's spoken question (speech from 3.0 to 4.8 s) from 2.5 s to 5.5 s."""
    with wave.open(str(QUESTION), "rb") as wav:
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768
    return pcm[int(2.5 * 16000) : int(5.5 * 16000)]


def question_units() -> list[np.ndarray]:
    """The spoken question in 1 s units, then 1 s of silence (the end of the user's turn)."""
    pcm = np.concatenate([question(), np.zeros(16000, np.float32)])
    return [pcm[i : i + 16000] for i in range(0, pcm.size - 15999, 16000)]


def call_turn(session, units, silence_limit=200, force_at=None, cap=20):
    """Feed a user turn, then silence (what the edge sends while the model answers) until the
    answer ends; returns (results while listening, answer results, the result ending it).
    An answer is stopped at `cap` pieces as max_new_tokens stops it in the unit loop: with
    speech on, a random TTS rarely ends a chunk, so one random answer runs for minutes."""
    listened, answer = [], []
    pending = list(units)
    stop_at = cap if force_at is None else force_at
    for _ in range(len(units) + silence_limit):
        pcm = pending.pop(0) if pending else np.zeros(16000, np.float32)
        session.prefill(pcm, [], 1)
        result = session.generate(bool(answer) and len(answer) == stop_at)
        session.finalize()
        if result.is_listen and result.end_of_turn:
            return listened, answer, result
        (listened if result.is_listen and not answer else answer).append(result)
    raise AssertionError("the answer did not end")


def test_a_half_duplex_call_says_it_has_no_context_window(engine):
    """The chat path has no sliding window: a call that asks for one is told so."""
    from omnifabric.worker.engines.minicpmo.engine import WINDOW_NOT_IN_CALLS

    s = engine.open_session("call-w", "audio")
    try:
        s.prepare("Be brief.", None, None, replace(CALL, context_window="basic"))
        assert WINDOW_NOT_IN_CALLS in s.notes
        s.prepare("Be brief.", None, None, CALL)
        assert WINDOW_NOT_IN_CALLS not in s.notes
    finally:
        s.close()


def test_a_half_duplex_call_answers_each_turn_and_keeps_its_context(engine):
    s = engine.open_session("call-1", "audio")
    try:
        prompt_tokens = s.prepare("Be brief.", None, None, CALL)
        assert prompt_tokens > 0
        assert not any("vad" in note for note in s.notes)  # the VAD settings are used
        # Silence is never a turn.
        for _ in range(3):
            s.prefill(np.zeros(16000, np.float32), [], 1)
            assert s.generate(False).is_listen
            s.finalize()
        listened, answer, end = call_turn(s, question_units())
        assert listened and all(r.is_listen for r in listened)
        assert answer and not any(r.is_listen for r in answer)
        first = answer[0]
        # The turn's audio went into the context as one user message after the prompt.
        assert first.input_audio_tokens > 10
        assert first.kv_cache_length > prompt_tokens + first.input_audio_tokens
        text = "".join(r.text for r in answer)
        assert text and sum(r.n_tokens for r in answer) > 0
        assert end.kv_cache_length >= answer[-1].kv_cache_length
        # The second turn starts from the first one's context, not from the prompt again.
        _, answer2, end2 = call_turn(s, question_units())
        assert answer2[0].kv_cache_length > end.kv_cache_length + answer2[0].input_audio_tokens
        assert end2.kv_cache_length > end.kv_cache_length
    finally:
        s.close()
    assert s.call is not None and s.call.reply is None


def test_a_half_duplex_answer_does_not_hear_and_stops_on_force_listen(engine):
    s = engine.open_session("call-2", "audio")
    try:
        s.prepare("Be brief.", None, None, CALL)
        _, answer, end = call_turn(s, question_units(), force_at=1)
        assert len(answer) == 1 and end.end_of_turn  # the external stop's unit ended it
        # Speech sent during an answer is not heard: the same question again, fed while the
        # model answers, starts no turn once the answer ended.
        for unit in question_units():
            s.prefill(unit, [], 1)
            s.generate(False)
            s.finalize()
        s.prefill(np.zeros(16000, np.float32), [], 1)
        after = s.generate(False)
        s.finalize()
        # A turn started after the stop is answered from the context the stop left.
        _, again, _ = call_turn(s, question_units())
        assert again and again[0].kv_cache_length > end.kv_cache_length
        assert after is not None
    finally:
        s.close()


def test_half_duplex_calls_interleaved_match_solo(engine):
    """Two calls on one model, unit by unit in turn, with a chat turn's chunks between: each
    answers exactly what it answers alone (the conversation kept on the model is swapped)."""

    def answers(session_units, other=None):
        out = []
        for pcm in session_units:
            for s, chat in [other] if other else []:
                s.prefill(np.zeros(16000, np.float32), [], 1)
                s.generate(False)
                s.finalize()
                next(chat, None)
            main.prefill(pcm, [], 1)
            r = main.generate(False)
            main.finalize()
            out.append((r.is_listen, r.text, r.kv_cache_length))
        return out

    units = question_units() + [np.zeros(16000, np.float32)] * 12
    main = engine.open_session("call-a", "audio")
    try:
        main.prepare("Be brief.", None, None, CALL)
        alone = answers(units)
    finally:
        main.close()
    main = engine.open_session("call-a", "audio")
    other = engine.open_session("call-b", "audio")
    turn = ChatTurn(messages=(ChatMessage("user", ("Hi.", noise(8))),), max_new_tokens=60)
    chat = engine.chat(turn)
    try:
        main.prepare("Be brief.", None, None, CALL)
        other.prepare("Answer in French.", None, None, CALL)
        mixed = answers(units, (other, chat))
    finally:
        list(chat)
        main.close()
        other.close()
    assert any(not listen for listen, _, _ in alone)
    assert mixed == alone


def test_a_chat_turn_hears_audio_longer_than_one_chunk(engine):
    """4.5 s of speech in one user message: whole where the code takes whole audio, in the
    model's streaming chunks where it only streams (both used to fail past one chunk)."""
    speech = np.concatenate([question(), question()])[: int(4.5 * 16000)]
    short = ChatTurn(messages=(ChatMessage("user", ("Hi.", speech[:16000])),), max_new_tokens=4)
    long = ChatTurn(messages=(ChatMessage("user", ("Hi.", speech)),), max_new_tokens=4)
    short_in = list(engine.chat(short))[0].input_tokens
    long_in = list(engine.chat(long))[0].input_tokens
    assert long_in > short_in + 20  # the whole 4.5 s reached the context
