"""Registered reference voices (/api/assets/ref_audio): stored normalized, listed, deleted,
kept across restarts; bad uploads refused with a message; the key checked when keys are on,
deleting needs an admin key."""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import socket
import urllib.error
import urllib.request
import wave

import numpy as np
import pytest

from omnifabric.edge.errors import InvalidPayload
from omnifabric.edge.recording import read_float32_wav
from omnifabric.edge.voices import VoiceRegistry
from tests.conftest import scaled
from tests.e2e.test_default_voice import http_url
from tests.stack import Stack


def wav_b64(seconds=1.0, rate=22050, channels=1) -> str:
    n = int(rate * seconds)
    tone = 0.3 * np.sin(2 * np.pi * 200 * np.arange(n) / rate)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.repeat(tone, channels) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def test_upload_list_delete_and_restart(tmp_path):
    registry = VoiceRegistry(tmp_path / "voices")
    assert registry.list() == {"total": 0, "ref_audios": []}
    anna = registry.upload("Anna", wav_b64(1.5, 22050, channels=2))
    listed = registry.list()
    assert listed["total"] == 1
    entry = listed["ref_audios"][0]
    assert (entry["id"], entry["name"], entry["duration_ms"]) == (anna.id, "Anna", 1500)
    assert entry["sample_rate"] == 16000 and entry["filename"] == f"{anna.id}.wav"
    with wave.open(str(tmp_path / "voices" / entry["filename"])) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
    pcm = np.frombuffer(registry.pcm(anna.id), "<f4")
    assert pcm.size == 24000 and 0.25 < np.abs(pcm).max() < 0.35
    again = VoiceRegistry(tmp_path / "voices")  # a restarted edge
    assert again.list() == listed
    assert again.delete(anna.id) and not again.delete(anna.id)
    assert VoiceRegistry(tmp_path / "voices").list()["total"] == 0
    assert not (tmp_path / "voices" / entry["filename"]).exists()
    assert registry.pcm("nope") is None


def _upload_many(root: str, tag: str, count: int) -> None:
    registry = VoiceRegistry(root)
    for i in range(count):
        registry.upload(f"{tag}-{i}", wav_b64(0.2))


def test_processes_sharing_the_folder_lose_nothing(tmp_path):
    # Two registries on one folder (two edge processes): each sees the other's changes.
    first, second = VoiceRegistry(tmp_path), VoiceRegistry(tmp_path)
    a = first.upload("a", wav_b64(0.2))
    b = second.upload("b", wav_b64(0.2))
    assert [v["name"] for v in first.list()["ref_audios"]] == ["a", "b"]
    assert second.pcm(a.id) is not None
    assert first.delete(b.id) and not second.delete(b.id)
    assert [v["name"] for v in second.list()["ref_audios"]] == ["a"]
    # Processes uploading at the same time: every upload is kept.
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_upload_many, args=(str(tmp_path), t, 8)) for t in "xyz"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(scaled(60))
        assert proc.exitcode == 0
    names = {v["name"] for v in first.list()["ref_audios"]}
    assert names == {"a"} | {f"{t}-{i}" for t in "xyz" for i in range(8)}
    assert len(list(tmp_path.glob("*.wav"))) == 25
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("name", "audio", "message"),
    [
        ("", wav_b64(), "name must be text"),
        ("x" * 101, wav_b64(), "name must be text"),
        (3, wav_b64(), "name must be text"),
        ("a", "%%%", "not valid base64"),
        ("a", base64.b64encode(b"not a wav at all").decode(), "unreadable WAV"),
        ("a", wav_b64(61.0, 8000), "at most 60 s"),
        ("a", None, "audio_base64 must be"),
    ],
)
def test_bad_uploads_are_refused(tmp_path, name, audio, message):
    registry = VoiceRegistry(tmp_path)
    with pytest.raises(InvalidPayload, match=message):
        registry.upload(name, audio)
    assert registry.list()["total"] == 0


def request(url, method, body=None, key=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=scaled(10)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post_bytes(url: str, data: bytes, key: str) -> tuple[int, dict]:
    """A POST of `data` as it is (not JSON-encoded here)."""
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=scaled(10)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def raw_delete(host: str, port: int, path: str, key: str) -> bytes:
    """A DELETE with no Content-Length header at all (as some clients send it)."""
    with socket.create_connection((host, port), timeout=scaled(10)) as sock:
        sock.sendall(
            f"DELETE {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_endpoints_through_a_real_edge(tmp_path):
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        keys = tmp_path / "keys"
        keys.write_text("k1\nk2 admin\n")
        stack.start_edge("--voices-dir", str(tmp_path / "v"), "--api-keys-file", str(keys))
        url = http_url(stack.url, "/api/assets/ref_audio")
        assert request(url, "GET")[0] == 401
        assert request(url, "POST", {"name": "A", "audio_base64": wav_b64()})[0] == 401
        status, body = request(url, "POST", {"name": "Anna", "audio_base64": wav_b64()}, "k1")
        assert status == 200 and body["success"] and body["name"] == "Anna"
        voice_id = body["id"]
        status, body = request(url, "GET", key="k1")
        assert status == 200 and [v["id"] for v in body["ref_audios"]] == [voice_id]
        status, body = request(url, "POST", {"name": "B", "audio_base64": "@@"}, "k1")
        assert status == 400 and body["error"] == "invalid_request" and "base64" in body["detail"]
        status, body = request(url, "POST", ["not", "an", "object"], "k1")
        assert status == 400 and body["detail"] == "the body must be a JSON object"
        # Bodies the JSON reader refuses, each answered (the handler lived through them).
        for data, detail in (
            (b"[" * 100_000 + b"]" * 100_000, "JSON nesting too deep"),
            (b'{"name": "A", "audio_base64": NaN}', "NaN is not a JSON number"),
            (b"\xff{", "the body is not JSON"),
            (b"{", "the body is not JSON"),
        ):
            status, body = post_bytes(url, data, "k1")
            assert (status, body["error"], body["detail"]) == (400, "invalid_request", detail)
        assert request(url, "PUT", {}, "k1")[0] == 405
        # Deleting a voice (everybody's) is the operator's: an admin key.
        status, body = request(f"{url}/{voice_id}", "DELETE", key="k1")
        assert status == 403 and body["message"] == "this needs an admin key"
        status, body = request(f"{url}/nope", "DELETE", key="k2")
        assert status == 404 and "nope" in body["message"]
        host, port = url.split("//")[1].split("/")[0].split(":")
        answer = raw_delete(host, int(port), f"/api/assets/ref_audio/{voice_id}", "k2")
        assert answer.startswith(b"HTTP/1.1 200") and voice_id.encode() in answer
        assert request(url, "GET", key="k1")[1]["total"] == 0
    finally:
        stack.stop()


async def test_a_session_names_a_registered_voice(tmp_path):
    """session.init with voice.ref_audio_id: the edge sends the registered audio as the
    session's reference voice (the recording shows what the worker got); an unknown id is
    refused like a bad field and the connection stays usable; audio and id together are
    refused."""
    from tests.e2e.wsclient import SILENCE, WsClient

    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--slots", "2", "--compute-ms", "5")
        records = tmp_path / "records"
        stack.start_edge("--voices-dir", str(tmp_path / "v"), "--record-dir", str(records))
        url = http_url(stack.url, "/api/assets/ref_audio")
        voice_id = request(url, "POST", {"name": "Anna", "audio_base64": wav_b64(1.25)})[1]["id"]
        client = await WsClient.open(f"{stack.url}?mode=audio")
        try:
            await client.until("session.queue_done", timeout_s=30)
            bad = {"system_prompt": "hi", "voice": {"ref_audio_id": "nope"}}
            await client.send({"type": "session.init", "payload": bad})
            err = await client.until("error")
            assert "ref_audio_id" in err["error"]["message"] and "nope" in err["error"]["message"]
            both = {"voice": {"ref_audio_id": voice_id, "ref_audio_base64": wav_b64()}}
            await client.send({"type": "session.init", "payload": both})
            err = await client.until("error")
            assert "not both" in err["error"]["message"]
            good = {"system_prompt": "hi", "voice": {"ref_audio_id": voice_id}}
            await client.send({"type": "session.init", "payload": good})
            created = await client.until("session.created")
            await client.append(SILENCE)
            await client.until("delta.listen", "response.output.delta")
        finally:
            await client.close()
        session_id = created["session_id"]
        audio, rate = read_float32_wav((records / session_id / "ref_audio.wav").read_bytes())
        assert (audio.size, rate) == (20000, 16000) and 0.25 < np.abs(audio).max() < 0.35
    finally:
        stack.stop()
