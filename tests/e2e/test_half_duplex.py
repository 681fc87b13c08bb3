"""The half-duplex voice call (/ws/half_duplex/{id}) on a real stack (synthetic engine): the
user speaks, vad_state and generating mark the end of the turn, the reply streams in chunks
to turn_done without further input from the client (input during the answer is ignored),
the next turn continues the same session; stop ends it."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect

from tests.conftest import scaled
from tests.e2e.wsclient import SILENCE, SPEECH
from tests.stack import Stack

HALF = 8000  # 0.5 s chunks, as the reference's pages send


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path)
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge()
    yield stack
    stack.stop()


def chunk(samples) -> str:
    audio = base64.b64encode(samples.astype("<f4").tobytes()).decode()
    return json.dumps({"type": "audio_chunk", "audio_base64": audio})


async def until(ws, kind: str, seen: list[dict]) -> dict:
    while True:
        event = json.loads(await ws.recv(decode=True))
        seen.append(event)
        if event["type"] == kind:
            return event
        assert event["type"] != "error", event


async def speak_a_turn(ws, seen: list[dict]) -> None:
    """One second of speech then one of silence, in real time as a microphone sends it (the
    worker keeps the newest unit when they come faster than it answers)."""
    for samples in (SPEECH[:HALF], SPEECH[HALF:], SILENCE[:HALF], SILENCE[HALF:]):
        await ws.send(chunk(samples))
        await asyncio.sleep(0.5)


def url(stack, sid: str) -> str:
    return stack.url.replace("/v1/realtime", f"/ws/half_duplex/{sid}")


async def test_two_turns_then_stop(stack):
    seen: list[dict] = []
    async with connect(url(stack, "hd_1"), open_timeout=scaled(10)) as ws:
        await until(ws, "queue_done", seen)
        await ws.send(json.dumps({"type": "prepare", "system_prompt": "be brief"}))
        prepared = await until(ws, "prepared", seen)
        assert prepared["session_id"] == "hd_1" and prepared["timeout_s"] > 0
        for turn in range(2):
            start = len(seen)
            await speak_a_turn(ws, seen)
            generating = await until(ws, "generating", seen)
            # The turn's speech; a chunk sent during the last answer may count here too, when
            # the answer had ended before it came.
            assert generating["speech_duration_ms"] in (1000, 1500)
            # Sent while the model answers: ignored, never an error.
            await ws.send(chunk(SPEECH[:HALF]))
            done = await until(ws, "turn_done", seen)
            turn_events = seen[start:]
            kinds = [e["type"] for e in turn_events]
            assert kinds.index("vad_state") < kinds.index("generating") < kinds.index("chunk")
            assert [e["speaking"] for e in turn_events if e["type"] == "vad_state"] == [True, False]
            chunks = [e for e in turn_events if e["type"] == "chunk"]
            assert len(chunks) >= 2 and all(c["audio_data"] for c in chunks)
            assert done["turn_index"] == turn + 1
            assert done["text"] == "".join(c["text_delta"] for c in chunks)
            assert f"reply {turn + 1}" in done["text"]
        await ws.send(json.dumps({"type": "stop"}))
        assert (await until(ws, "stopped", seen))["session_id"] == "hd_1"


@pytest.mark.ci_long  # a recording sent in many chunk sizes: ~7 s (tests/conftest.py)
async def test_a_recording_in_chunks_of_any_length_is_answered(stack):
    """A recording cut into 0.5 s chunks ends with a short piece (here 2484 samples), and
    other clients send 64 ms frames: every chunk is taken (none refused) and the turn is
    answered (issue 36)."""
    seen: list[dict] = []
    speech = np.concatenate([SPEECH, SPEECH[:2484]])
    async with connect(url(stack, "hd_any"), open_timeout=scaled(10)) as ws:
        await until(ws, "queue_done", seen)
        await ws.send(json.dumps({"type": "prepare"}))
        await until(ws, "prepared", seen)
        for turn, size in enumerate((HALF, 1024)):
            for start in range(0, len(speech), size):
                await ws.send(chunk(speech[start : start + size]))
                await asyncio.sleep(size / 16000)
            for _ in range(4):  # then silence, as a microphone goes on sending
                await ws.send(chunk(SILENCE[:HALF]))
                await asyncio.sleep(0.5)
            assert (await until(ws, "generating", seen))["speech_duration_ms"] >= 1000
            done = await until(ws, "turn_done", seen)
            assert done["turn_index"] == turn + 1 and done["text"]
        assert not [e for e in seen if e["type"] == "error"]


async def test_the_edge_sends_no_unit_per_piece_of_the_answer(stack):
    """The worker goes on with the answer by itself: the edge forwards only the client's
    chunks (at most the turn's 4; the last may come once the answer began, ignored), none
    per piece of the 3-piece answer (it used to send one after each piece but the last)."""
    from tests.e2e.test_metrics import scrape, total

    seen: list[dict] = []
    async with connect(url(stack, "hd_units"), open_timeout=scaled(10)) as ws:
        await until(ws, "queue_done", seen)
        await ws.send(json.dumps({"type": "prepare"}))
        await until(ws, "prepared", seen)
        await speak_a_turn(ws, seen)
        done = await until(ws, "turn_done", seen)
        assert done["text"].count("part") == 3
        edge = await asyncio.to_thread(scrape, stack.url.removeprefix("ws://").split("/")[0])
        assert total(edge, "omni_edge_outputs_total", kind="speak") == 3
        assert 3 <= total(edge, "omni_edge_units_forwarded_total") <= 4


@pytest.mark.ci_long  # two answers cut at their limit: ~4 s (tests/conftest.py)
async def test_max_new_tokens_ends_each_answer(stack):
    """config.generation.max_new_tokens caps each answer (the worker ends it, with no unit
    from the edge per piece): the synthetic engine's pieces are 4 tokens, so with 4 each
    answer stops after its first piece, turn after turn."""
    seen: list[dict] = []
    async with connect(url(stack, "hd_cap"), open_timeout=scaled(10)) as ws:
        await until(ws, "queue_done", seen)
        prepare = {"type": "prepare", "config": {"generation": {"max_new_tokens": 4}}}
        await ws.send(json.dumps(prepare))
        await until(ws, "prepared", seen)
        for turn in (1, 2):
            start = len(seen)
            await speak_a_turn(ws, seen)
            done = await until(ws, "turn_done", seen)
            assert done["turn_index"] == turn and done["text"] == f"reply {turn} part 1 "
            chunks = [e for e in seen[start:] if e["type"] == "chunk"]
            assert [c["text_delta"] for c in chunks] == [f"reply {turn} part 1 "]


async def test_bad_input_answers_error_and_the_call_goes_on(stack):
    seen: list[dict] = []
    async with connect(url(stack, "hd_2"), open_timeout=scaled(10)) as ws:
        await until(ws, "queue_done", seen)
        await ws.send(chunk(SPEECH[:HALF]))  # before prepare
        assert "prepare" in (await until(ws, "error", seen))["error"]
        await ws.send(json.dumps({"type": "prepare", "system_prompt": 5}))
        assert "system_prompt" in (await until(ws, "error", seen))["error"]
        await ws.send(json.dumps({"type": "dance"}))
        assert "dance" in (await until(ws, "error", seen))["error"]
        await ws.send(json.dumps({"type": "prepare", "config": {"tts": {"enabled": False}}}))
        await until(ws, "prepared", seen)
        await speak_a_turn(ws, seen)
        done = await until(ws, "turn_done", seen)
        chunks = [e for e in seen if e["type"] == "chunk"]
        assert chunks and all(c["audio_data"] is None for c in chunks)  # text only
        assert done["turn_index"] == 1


@pytest.mark.ci_long  # a call answered then stopped from outside: ~5 s (tests/conftest.py)
async def test_an_external_stop_ends_the_answer(tmp_path):
    """POST /api/half_duplex/stop {session_id} while the model answers: its turn ends at once
    (turn_done with what was said so far, fewer chunks than a whole reply); unknown ids 404."""
    from tests.e2e.test_default_voice import http_url
    from tests.edge.test_voices import request

    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "2", "--compute-ms", "400")  # a 3-unit answer: ~1.2 s
        stack.start_edge()
        stop_url = http_url(stack.url, "/api/half_duplex/stop")
        seen: list[dict] = []
        async with connect(url(stack, "hd_stop"), open_timeout=scaled(10)) as ws:
            await until(ws, "queue_done", seen)
            await ws.send(json.dumps({"type": "prepare"}))
            await until(ws, "prepared", seen)
            assert request(stop_url, "POST", {"session_id": "hd_stop"})[1]["success"] is False
            await speak_a_turn(ws, seen)
            await until(ws, "generating", seen)
            status, body = await asyncio.to_thread(
                request, stop_url, "POST", {"session_id": "hd_stop"}
            )
            assert status == 200 and body["success"] is True, body
            start = len(seen)
            done = await until(ws, "turn_done", seen)
            assert done["turn_index"] == 1
            chunks = [e for e in seen if e["type"] == "chunk"]
            assert len(chunks) < 3, [e["type"] for e in seen[start:]]
        assert request(stop_url, "POST", {"session_id": "nope"})[0] == 404
        assert request(stop_url, "POST", {"nothing": 1})[0] == 400
    finally:
        stack.stop()


async def test_the_call_times_out_without_audio(stack):
    """config.session.timeout_s: a call with no audio_chunk for that long ends with timeout;
    each chunk restarts the clock; an out-of-range value is refused."""
    seen: list[dict] = []
    async with connect(url(stack, "hd_idle"), open_timeout=scaled(10)) as ws:
        await until(ws, "queue_done", seen)
        await ws.send(json.dumps({"type": "prepare", "config": {"session": {"timeout_s": 0}}}))
        assert "timeout_s" in (await until(ws, "error", seen))["error"]
        prepare = {"type": "prepare", "config": {"session": {"timeout_s": 1.5}}}
        await ws.send(json.dumps(prepare))
        assert (await until(ws, "prepared", seen))["timeout_s"] == 1.5
        for _ in range(3):  # 3 s of chunks, each within the timeout: the call goes on
            await ws.send(chunk(SILENCE[:HALF]))
            await asyncio.sleep(0.5)
        await ws.send(chunk(SILENCE[:HALF]))
        timeout = await asyncio.wait_for(until(ws, "timeout", seen), scaled(10))
        assert 1.4 <= timeout["elapsed_s"] <= scaled(4)
        assert "stopped" not in [e["type"] for e in seen]
