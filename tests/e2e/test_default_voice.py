"""GET /api/default_ref_audio: the default voice as the reference server serves it (float32
16 kHz PCM in base64 with name, duration, sample count), no key needed; 404 without one."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import wave

import numpy as np
import pytest

from tests.conftest import scaled
from tests.stack import Stack


def http_url(ws_url: str, path: str) -> str:
    return ws_url.replace("ws://", "http://").removesuffix("/v1/realtime") + path


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=scaled(10)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def voice_wav(tmp_path):
    path = tmp_path / "voice.wav"
    tone = 0.3 * np.sin(2 * np.pi * 200 * np.arange(22050 * 2) / 22050)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22050)
        w.writeframes((tone * 32767).astype("<i2").tobytes())
    return path


def test_default_ref_audio_served_and_absent(tmp_path, voice_wav):
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        keys = tmp_path / "keys"
        keys.write_text("k1\n")
        stack.start_edge("--default-ref-audio", str(voice_wav), "--api-keys-file", str(keys))
        status, body = get(http_url(stack.url, "/api/default_ref_audio"))
        assert status == 200
        assert body["name"] == "voice.wav" and body["sample_rate"] == 16000
        pcm = np.frombuffer(base64.b64decode(body["base64"]), "<f4")
        assert pcm.size == body["samples"] == 32000 and body["duration"] == 2.0
        assert 0.25 < np.abs(pcm).max() < 0.35  # the tone, resampled to 16 kHz
        stack.edge.stop()
        stack.start_edge()
        status, body = get(http_url(stack.url, "/api/default_ref_audio"))
        assert status == 404 and "no default reference audio" in body["error"]
    finally:
        stack.stop()
