"""Recorded sessions over HTTP (/api/sessions...): listed, read with their per-unit
timeline, their files served (and nothing outside their folder), zipped; a key when keys
are on; 404 when the edge records nothing."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import urllib.error
import urllib.request
import zipfile

import numpy as np
import pytest

from tests.conftest import scaled
from tests.e2e.test_default_voice import http_url
from tests.e2e.test_queue_api import USER, open_client
from tests.e2e.wsclient import SILENCE, SPEECH
from tests.edge.test_voices import request
from tests.stack import Stack, keyed_stack


def raw_get(url: str, key: str | None = USER) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=scaled(10)) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.fixture
def stack(tmp_path):
    stack = keyed_stack(tmp_path, f"{USER}\n", "--record-dir", str(tmp_path / "records"))
    yield stack
    stack.stop()


async def record_a_session(stack) -> str:
    client = await open_client(stack, USER)
    created = await client.start(prompt="be brief")
    for samples in (SPEECH, SILENCE, SILENCE):
        await client.append(samples)
        await client.until("delta.listen", "response.output.delta")
    await client.send({"type": "session.close"})
    await client.until("session.closed")
    await client.close()
    return created["session_id"]


async def test_sessions_listed_read_served_and_zipped(stack, tmp_path):
    sid = await record_a_session(stack)
    base = http_url(stack.url, "/api/sessions")
    assert request(base, "GET")[0] == 401
    status, body = request(base, "GET", key=USER)
    assert status == 200 and body["total"] == 1
    (entry,) = body["sessions"]
    assert (entry["session_id"], entry["mode"], entry["units"]) == (sid, "audio", 3)
    assert entry["size_bytes"] > 0 and entry["duration_s"] is not None

    status, meta = request(f"{base}/{sid}", "GET", key=USER)
    assert status == 200 and meta["system_prompt"] == "be brief"
    assert [u["seq"] for u in meta["timeline"]] == [1, 2, 3]
    assert all("wall_clock_ms" in u for u in meta["timeline"])
    status, timeline = request(f"{base}/{sid}/recording", "GET", key=USER)
    assert status == 200 and timeline["units"] == meta["timeline"]
    # The reference server's shape too: its clients read `chunks` and their assets.
    assert timeline["mode"] == "duplex" and [c["index"] for c in timeline["chunks"]] == [0, 1, 2]
    assert meta["app_type"] == "audio_duplex" and meta["config"]["system_prompt"] == "be brief"
    status, _, chunk_wav = raw_get(f"{base}/{sid}/assets/{timeline['chunks'][0]['user_audio']}")
    assert status == 200 and chunk_wav[:4] == b"RIFF"

    status, headers, wav = raw_get(f"{base}/{sid}/assets/user.wav")
    assert status == 200 and headers["Content-Type"] == "audio/wav" and wav[:4] == b"RIFF"
    status, _, unit = raw_get(f"{base}/{sid}/assets/in/000001.wav")
    assert status == 200 and unit[:4] == b"RIFF"
    for bad in ("../../keys", "..%2F..%2Fkeys", "in/../../../keys", ".hidden", "in/"):
        assert raw_get(f"{base}/{sid}/assets/{bad}")[0] in (400, 404), bad
    assert raw_get(f"{base}/{sid}/assets/nope.wav")[0] == 404

    status, headers, data = raw_get(f"{base}/{sid}/download")
    assert status == 200 and headers["Content-Type"] == "application/zip"
    assert f'filename="{sid}.zip"' in headers["Content-Disposition"]
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert f"{sid}/meta.json" in names and f"{sid}/user.wav" in names
    assert json.loads(zipfile.ZipFile(io.BytesIO(data)).read(f"{sid}/meta.json"))["units"] == 3

    assert request(f"{base}/nope_123", "GET", key=USER)[0] == 404
    assert request(f"{base}/bad%20id", "GET", key=USER)[0] == 400
    assert request(f"{base}/{sid}/other", "GET", key=USER)[0] == 404
    status, headers, page = raw_get(http_url(stack.url, f"/s/{sid}"), key=None)
    assert status == 200 and b"viewer.js" in page  # the page needs no key; its data does


async def test_an_edge_that_records_nothing_says_so(tmp_path):
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_edge()
        status, body = request(http_url(stack.url, "/api/sessions"), "GET")
        assert status == 404 and "--record-dir" in body["message"]
    finally:
        stack.stop()


async def test_flat_dialects_name_their_recording(stack, tmp_path):
    """Legacy duplex and half-duplex sessions are recorded too: `prepared` names the
    recording, which /api/sessions serves. A client-chosen id that is taken, or that holds a
    character a recording id may not, gets a recording id of its own."""
    from websockets.asyncio.client import connect

    from tests.e2e.test_half_duplex import chunk, speak_a_turn, until

    headers = {"Authorization": f"Bearer {USER}"}
    ids = []
    for path in ("/ws/duplex/adx_same.1", "/ws/duplex/adx_same.1", "/ws/half_duplex/hd_rec"):
        seen: list[dict] = []
        url = stack.url.replace("/v1/realtime", path)
        async with connect(url, additional_headers=headers, open_timeout=scaled(10)) as ws:
            await until(ws, "queue_done", seen)
            await ws.send(json.dumps({"type": "prepare", "system_prompt": "be brief"}))
            prepared = await until(ws, "prepared", seen)
            if "half_duplex" in path:
                await speak_a_turn(ws, seen)
                await until(ws, "turn_done", seen)
            else:
                for samples in (SPEECH, SILENCE):
                    await ws.send(chunk(samples))
                    await until(ws, "result", seen)
            await ws.send(json.dumps({"type": "stop"}))
            await until(ws, "stopped", seen)
        ids.append(prepared["recording_session_id"])
    legacy_1, legacy_2, half = ids
    assert legacy_1.startswith("adx_same_1") and legacy_2.startswith("adx_same_1-")
    assert half == "hd_rec" and len(set(ids)) == 3

    base = http_url(stack.url, "/api/sessions")
    deadline = scaled(10)
    while True:  # the edge finishes a recording just after the connection ended
        listing = request(base, "GET", key=USER)[1]["sessions"]
        paths = {s["session_id"]: s["path"] for s in listing}
        if all(s["ended_at"] for s in listing) and len(listing) == 3 or deadline < 0:
            break
        await asyncio.sleep(0.1)
        deadline -= 0.1
    assert paths == {
        legacy_1: "/ws/duplex/adx_same.1",
        legacy_2: "/ws/duplex/adx_same.1",
        half: "/ws/half_duplex/hd_rec",
    }
    for rid in ids:
        status, body = request(f"{base}/{rid}", "GET", key=USER)
        assert status == 200 and body["recording_id"] == rid and body["timeline"]
    # The half-duplex answer's audio is referenced or counted, never inline.
    status, _, events = raw_get(f"{base}/{half}/assets/events.jsonl")
    lines = [json.loads(line) for line in events.decode().splitlines()]
    chunks = [e["event"] for e in lines if e["event"]["type"] == "chunk"]
    assert status == 200 and chunks
    assert all(isinstance(c["audio_data"], dict) for c in chunks)
    assert max(len(line) for line in events.decode().splitlines()) < 2000
    # The reference server's layouts: half-duplex turn by turn, legacy duplex unit by unit.
    status, timeline = request(f"{base}/{half}/recording", "GET", key=USER)
    assert timeline["mode"] == "half_duplex_audio" and "chunks" not in timeline
    [turn] = timeline["turns"]
    assert turn["turn_index"] == 0 and turn["input"]["type"] == "voice"
    assert turn["input"]["duration_ms"] >= 1000 and turn["output"]["text"]
    turn_answer = "".join(c.get("text_delta") or "" for c in chunks)
    assert turn["output"]["text"] == turn_answer
    assert turn["input"]["audio"] == "user_audio/000.wav"
    assert turn["output"]["audio"] == "ai_audio/turn_0.wav"
    assert turn["output"]["audio_duration_ms"] > 0
    for asset in (turn["input"]["audio"], turn["output"]["audio"]):
        status, _, wav = raw_get(f"{base}/{half}/assets/{asset}")
        assert status == 200 and wav[:4] == b"RIFF", asset
    assert turn["timing"]["elapsed_ms"] >= 0
    status, timeline = request(f"{base}/{legacy_1}/recording", "GET", key=USER)
    assert timeline["mode"] == "duplex" and len(timeline["chunks"]) == 2


def multipart(fields: list[tuple[str, str, bytes]], boundary: str = "b0undary") -> bytes:
    """A multipart/form-data body: (field name, content type, data) per part."""
    out = b""
    for name, content_type, data in fields:
        out += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                f'filename="{name}.bin"\r\nContent-Type: {content_type}\r\n\r\n'
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode()


def post(url: str, body: bytes, content_type: str, key: str | None = USER) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("Content-Type", content_type)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=scaled(30)) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


async def test_a_page_uploads_its_recording_of_the_session(stack, tmp_path):
    sid = await record_a_session(stack)
    base = http_url(stack.url, "/api/sessions")
    url = f"{base}/{sid}/upload-recording"
    form = "multipart/form-data; boundary=b0undary"
    # 3 MB of "video" (random bytes hold every byte value, CRLFs and dashes included).
    video = np.random.default_rng(5).integers(0, 256, 3 * 1024 * 1024, dtype=np.uint8).tobytes()
    body = multipart([("note", "text/plain", b"hello"), ("file", "video/webm", video)])
    status, answer = await asyncio.to_thread(post, url, body, form)
    assert status == 200, answer
    assert answer == {"status": "ok", "path": "frontend_replay.webm", "size_bytes": len(video)}
    assert (tmp_path / "records" / sid / "frontend_replay.webm").read_bytes() == video
    assert not list((tmp_path / "records" / sid).glob(".*.tmp"))
    status, headers, served = raw_get(f"{base}/{sid}/assets/frontend_replay.webm")
    assert status == 200 and headers["Content-Type"] == "video/webm" and served == video

    small = multipart([("file", "audio/wav", b"RIFF....")])
    cases = [
        (post(url, small, form, key=None), 401, "unauthorized"),
        (post(f"{base}/nope_123/upload-recording", small, form), 404, "not_found"),
        (post(f"{base}/bad%20id/upload-recording", small, form), 400, "invalid_request"),
        (post(url, multipart([("file", "text/html", b"<p>")]), form), 400, "invalid_request"),
        (post(url, multipart([("other", "audio/wav", b"x")]), form), 400, "invalid_request"),
        (post(url, small, "application/json"), 400, "invalid_request"),
        (post(url, small[:40], form), 400, "invalid_request"),
    ]
    for (status, answer), want_status, want_code in cases:
        assert (status, answer.get("error")) == (want_status, want_code), answer
    assert "Unsupported file type: text/html" in cases[3][0][1]["message"]
    # Past 200 MB (as Content-Length says) it is refused before the body is read.
    with socket.create_connection(stack.url.split("/")[2].rsplit(":", 1)) as sock:
        sock.sendall(
            (
                f"POST /api/sessions/{sid}/upload-recording HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {USER}\r\nContent-Type: {form}\r\n"
                f"Content-Length: {201 * 1024 * 1024}\r\n\r\n"
            ).encode()
        )
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413") and "too_large" in head
    # The earlier file is still the one stored.
    assert (tmp_path / "records" / sid / "frontend_replay.webm").read_bytes() == video
