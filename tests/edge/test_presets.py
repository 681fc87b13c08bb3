"""System-prompt presets: the files an operator edits, listed and served as the reference
server does (metadata in the listing, audio on request), edits picked up without a restart,
bad files skipped, audio paths kept inside the presets folder."""

from __future__ import annotations

import base64
import json
import os
import wave

import numpy as np
import pytest

from omnifabric.edge.presets import PACKAGED, Presets
from tests.e2e.test_default_voice import get, http_url
from tests.stack import Stack


def write_wav(path, seconds=1.5, rate=24000):
    path.parent.mkdir(parents=True, exist_ok=True)
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(int(rate * seconds)) / rate)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((tone * 32767).astype("<i2").tobytes())


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "presets"
    (root / "omni").mkdir(parents=True)
    (root / "turnbased").mkdir()
    write_wav(root / "voices" / "anna.wav")
    (root / "omni" / "b_call.yaml").write_text(
        "id: call\norder: 2\nname: Call\ndescription: a call\n"
        "system_prompt: Be brief.\nref_audio_path: voices/anna.wav\nlanguage: en\n"
    )
    (root / "omni" / "a_first.yaml").write_text(
        "order: 1\nsystem_content:\n  - {type: text, text: You hear this voice}\n"
        "  - {type: audio, path: voices/anna.wav}\n"
    )
    (root / "turnbased" / "plain.json").write_text(json.dumps({"name": "Plain"}))
    return root


def test_listing_carries_metadata_in_order(root):
    listing = Presets(root).listing()
    assert sorted(listing) == ["omni", "turnbased"]
    first, call = listing["omni"]
    assert (first["id"], first["order"], first["name"]) == ("a_first", 1, "a_first")
    assert first["system_content"] == [
        {"type": "text", "text": "You hear this voice"},
        {"type": "audio", "data": None, "path": "voices/anna.wav", "name": "anna.wav",
         "duration": 1.5},
    ]  # fmt: skip
    assert call["ref_audio"] == {
        "data": None, "path": "voices/anna.wav", "name": "anna.wav", "duration": 1.5
    }  # fmt: skip
    assert "ref_audio_path" not in call and call["language"] == "en"  # extra keys kept
    assert listing["turnbased"] == [
        {"id": "plain", "order": 999, "name": "Plain", "description": ""}
    ]


def test_audio_is_decoded_on_request(root):
    presets = Presets(root)
    audio = presets.audio("omni", "call")
    assert set(audio) == {"ref_audio"}
    pcm = np.frombuffer(base64.b64decode(audio["ref_audio"]["data"]), "<f4")
    assert pcm.size == 24000 and audio["ref_audio"]["duration"] == 1.5  # 16 kHz
    parts = presets.audio("omni", "a_first")["system_content_audio"]
    assert len(parts) == 1 and parts[0]["name"] == "anna.wav" and parts[0]["data"]
    assert presets.audio("omni", "nope") is None and presets.audio("nope", "call") is None


def test_bad_files_are_skipped_and_paths_stay_inside(root, tmp_path):
    write_wav(tmp_path / "secret.wav")
    (root / "omni" / "broken.yaml").write_text("id: [unclosed\n")
    (root / "omni" / "list.yaml").write_text("- not a mapping\n")
    (root / "omni" / "escape.yaml").write_text("id: escape\nref_audio_path: ../secret.wav\n")
    (root / "omni" / "dup.yaml").write_text("id: call\n")
    presets = Presets(root)
    ids = [p["id"] for p in presets.listing()["omni"]]
    assert sorted(ids) == ["a_first", "call", "escape"]
    escape = next(p for p in presets.listing()["omni"] if p["id"] == "escape")
    assert escape["ref_audio"]["duration"] == 0
    assert presets.audio("omni", "escape")["ref_audio"]["data"] is None


def test_an_edit_is_picked_up_without_a_restart(root):
    presets = Presets(root)
    assert presets.listing()["omni"][1]["name"] == "Call"
    path = root / "omni" / "b_call.yaml"
    path.write_text(path.read_text().replace("name: Call", "name: Renamed"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert presets.listing()["omni"][1]["name"] == "Renamed"
    (root / "turnbased" / "plain.json").unlink()
    assert "turnbased" not in presets.listing()


def test_the_packaged_presets_load():
    listing = Presets().listing()
    assert PACKAGED.is_dir()
    assert {"turnbased", "audio_duplex", "omni", "half_duplex_audio"} <= set(listing)
    assert all(p["system_prompt"] for mode in listing.values() for p in mode)


def test_endpoints_through_a_real_edge(tmp_path, root):
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        keys = tmp_path / "keys"
        keys.write_text("k1\n")
        stack.start_edge("--presets-dir", str(root), "--api-keys-file", str(keys))
        status, body = get(http_url(stack.url, "/api/presets"))  # no key needed
        assert status == 200 and [p["id"] for p in body["omni"]] == ["a_first", "call"]
        status, body = get(http_url(stack.url, "/api/presets/omni/call/audio"))
        assert status == 200 and body["ref_audio"]["name"] == "anna.wav"
        status, body = get(http_url(stack.url, "/api/presets/omni/missing/audio"))
        assert status == 404 and body["error"] == "not_found" and "omni/missing" in body["detail"]
        status, body = get(http_url(stack.url, "/api/presets/omni/%2e%2e/audio"))
        assert status == 404
        status, body = get(http_url(stack.url, "/api/presets/omni"))
        assert status == 404 and body["success"] is False
        status, body = get(http_url(stack.url, "/api/frontend_defaults"))
        assert status == 200 and body == {"playback_delay_ms": 200}
    finally:
        stack.stop()
