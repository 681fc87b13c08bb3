"""Session recording (edge --record-dir) and `omnifabric replay`, through real processes."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from omnifabric.edge.recording import float32_wav, prune, read_float32_wav
from tests.conftest import ROOT, scaled
from tests.stack import Stack

# CI's long group: a reference worker of its own (--turn-work finalize) and sessions on the
# real models, ~30 s in all.
pytestmark = pytest.mark.ci_long

FIXTURE = ROOT / "tests" / "fixtures" / "speech" / "question.wav"


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recordings")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, record_dir):
    s = Stack(tmp_path_factory.mktemp("logs"))
    try:
        s.start_scheduler()
        # Where a turn's end is worked out is fixed: `auto` learns the engine's costs as it
        # runs, and a replay on the warmed engine could start the reply a unit sooner.
        s.start_worker("--engine", "reference", "--slots", "2", "--turn-work", "finalize")
        s.start_edge("--record-dir", str(record_dir))
        yield s
    finally:
        s.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omnifabric.tools.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )


def _finished(folder: Path) -> dict:
    """meta.json once the edge has finished the recording (after the connection ended)."""
    deadline = time.monotonic() + scaled(10)
    while True:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("ended_at") or time.monotonic() > deadline:
            return meta
        time.sleep(0.05)


def _strings(value, out: list[str]) -> list[str]:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)
    return out


async def test_no_record_dir_writes_nothing(tmp_path):
    # First in the file: it runs before the module's recording stack starts (default ports).
    from omnifabric.tools.client import SILENCE_UNIT, run_session

    s = Stack(tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    try:
        s.start_scheduler()
        s.start_worker("--engine", "synthetic", "--compute-ms", "5")
        s.start_edge()
        report = await run_session(f"{s.url}?mode=audio", [SILENCE_UNIT] * 3, pace_s=0)
    finally:
        s.stop()
    assert report.session_id and report.closed_reason == "user_stop"
    assert not (ROOT / report.session_id).exists()
    assert not any(p.name == report.session_id for p in tmp_path.rglob("*"))
    assert "recording" not in s.edge.log().lower()


def test_record_then_replay(stack, record_dir, tmp_path):
    probe = _cli(
        *("probe", "--url", stack.url, "--mode", "audio", "--input", str(FIXTURE)),
        *("--fast", "--tail", "2", "--quiet"),
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    folders = [p for p in record_dir.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    folder = folders[0]
    meta = _finished(folder)
    assert meta["session_id"] == folder.name
    assert meta["mode"] == "audio" and meta["dialect"] == "current"
    assert meta["system_prompt"] == "You are a helpful assistant."
    assert meta["close_reason"] == "user_stop" and meta["ended_at"]
    n_units = 15 + 2  # 14.03 s of question (the last unit padded) + 2 silent units
    assert meta["units"] == n_units

    # events.jsonl: every line timestamped, directions both ways, never inline audio.
    lines = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert {rec["dir"] for rec in lines} == {"in", "out"}
    assert all({"t", "wall", "dir", "event"} <= rec.keys() for rec in lines)
    assert max(len(s) for rec in lines for s in _strings(rec, [])) < 1000
    types = [rec["event"]["type"] for rec in lines]
    assert types[0] == "session.queue_done" and "session.init" in types
    assert types.count("input.append") == n_units and types[-1] == "session.closed"
    audio_refs = [rec["event"]["audio"] for rec in lines if rec["event"].get("kind") == "audio"]
    assert audio_refs and all(ref["wav"] == "model.wav" for ref in audio_refs)

    # Audio: user.wav 16 kHz, model.wav 24 kHz, each unit's exact input.
    with wave.open(str(folder / "user.wav")) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (16000, 2, 1)
        assert w.getnframes() == n_units * 16000
    with wave.open(str(folder / "model.wav")) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (24000, 2, 1)
        assert 24000 < w.getnframes() == sum(ref["samples"] for ref in audio_refs)
    first, rate = read_float32_wav((folder / "in" / "000001.wav").read_bytes())
    with wave.open(str(FIXTURE)) as w:
        source = np.frombuffer(w.readframes(16000), "<i2").astype(np.float32) / 32768.0
    assert rate == 16000 and np.array_equal(first, source)
    assert len(list((folder / "in").glob("*.wav"))) == n_units

    # units.jsonl: one line per unit, with timings, and one per output the worker sent
    # between units (`early`: a reply's start after its unit listened, or the speech after
    # a short first piece), right after its unit's own line; the answer is spoken.
    units = [json.loads(line) for line in (folder / "units.jsonl").read_text().splitlines()]
    own = [u for u in units if not u.get("early")]
    assert [u["seq"] for u in own] == list(range(1, n_units + 1))
    assert {"kind", "text", "end_of_turn", "kv", "prefill_ms", "edge_ms"} <= units[0].keys()
    for before, line in zip(units, units[1:], strict=False):
        if line.get("early"):
            assert line["kind"] == "speak" and line["seq"] == before["seq"], (before, line)
    speak = [u for u in units if u["kind"] == "speak"]
    assert speak and speak[-1]["end_of_turn"]
    assert "paris" in "".join(u["text"] for u in speak).lower()
    assert all(u["edge_ms"] is not None and u["edge_ms"] >= 0 for u in own)

    # The reference server's layout: recording.json's chunks, 16-bit WAVs its tools read,
    # meta.json's names for what its clients read.
    assert meta["app_type"] == "audio_duplex" and meta["created_at"] == meta["started_at"]
    assert meta["worker_id"] and meta["duration_s"] > 0 and meta["title"].startswith("Session ")
    assert meta["config"]["system_prompt"] == "You are a helpful assistant."
    recording = json.loads((folder / "recording.json").read_text())
    assert recording["session_id"] == folder.name and recording["mode"] == "duplex"
    assert recording["worker_id"] == meta["worker_id"]
    assert recording["config"]["system_prompt"] == meta["system_prompt"]
    chunks = recording["chunks"]
    assert [c["index"] for c in chunks if not c["result"].get("early")] == list(range(n_units))
    assert [c["result"]["mode"] for c in chunks] == [u["kind"].upper() for u in units]
    assert all(c["receive_ts_ms"] > 0 for c in chunks)
    stamps = [c["receive_ts_ms"] for c in chunks]
    assert stamps == sorted(stamps)
    assert {"prefill_ms", "wall_clock_ms", "kv_cache_length"} <= chunks[0]["result"][
        "timing"
    ].keys()
    with wave.open(str(folder / chunks[0]["user_audio"])) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (16000, 2, 1)
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32767.0
    assert np.abs(pcm - source).max() < 1e-3
    spoken = [c["result"] for c in chunks if c["result"]["mode"] == "SPEAK"]
    assert "paris" in "".join(r.get("text", "") for r in spoken).lower()
    assert spoken[-1]["end_of_turn"] is True
    speech = 0
    for i, result in enumerate(r for r in spoken if "ai_audio" in r):
        assert result["ai_audio"] == f"ai_audio/turn_0_chunk_{i:03d}.wav"
        with wave.open(str(folder / result["ai_audio"])) as w:
            assert (w.getframerate(), w.getsampwidth()) == (24000, 2)
            assert result["ai_audio_duration_ms"] == round(w.getnframes() / 24)
            speech += w.getnframes()
    with wave.open(str(folder / "model.wav")) as w:
        assert speech == w.getnframes()

    # The reference engine is deterministic: the replay matches unit for unit.
    replay = _cli("replay", str(folder), "--url", stack.url, "--fast")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "timeline: match" in replay.stdout and "text: match" in replay.stdout

    # A recording whose text differs in one unit fails the replay, naming that unit.
    edited = tmp_path / folder.name
    shutil.copytree(folder, edited)
    target = speak[0]["seq"]
    with open(edited / "units.jsonl", "w") as f:
        for u in units:
            if u is speak[0]:
                u = dict(u, text="Something else entirely.")
            f.write(json.dumps(u) + "\n")
    replay = _cli("replay", str(edited), "--url", stack.url, "--fast")
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert f"unit {target}: text differs" in replay.stdout
    assert "text: 1 units differ" in replay.stdout
    assert (
        _cli("replay", str(edited), "--url", stack.url, "--fast", "--tolerance", "1").returncode
        == 0
    )


def _fake(root: Path, name: str, size: int, age_s: float, now: float) -> Path:
    folder = root / name
    (folder / "in").mkdir(parents=True)
    (folder / "meta.json").write_text("{}")
    (folder / "in" / "000001.wav").write_bytes(b"\0" * size)
    for path in (folder / "meta.json", folder / "in" / "000001.wav"):
        os.utime(path, (now - age_s, now - age_s))
    return folder


def test_retention_by_age_then_size(tmp_path):
    now = time.time()
    _fake(tmp_path, "ancient", 100, 10 * 86400, now)
    _fake(tmp_path, "old", 4000, 3000, now)
    _fake(tmp_path, "mid", 4000, 2000, now)
    _fake(tmp_path, "new", 4000, 1000, now)
    active = _fake(tmp_path, "active", 4000, 5000, now)
    (tmp_path / "not-a-recording").mkdir()
    (tmp_path / "not-a-recording" / "data").write_bytes(b"\0" * 100_000)
    # Older than a day goes; then oldest first until under 12.1 kB; active folders stay.
    removed = prune(tmp_path, 86400, 12_100, now=now, active={active})
    assert removed == ["ancient", "old"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["active", "mid", "new", "not-a-recording"]
    assert prune(tmp_path, 1500, 10**9, now=now, active=set()) == ["active", "mid"]
    assert prune(tmp_path / "missing", 1, 1) == []


def test_float32_wav_round_trip():
    samples = np.random.default_rng(3).standard_normal(16000).astype("<f4")
    data = float32_wav(samples.tobytes())
    back, rate = read_float32_wav(data)
    assert rate == 16000 and back.dtype == np.float32 and np.array_equal(back, samples)
    from scipy.io import wavfile  # an independent reader agrees

    rate2, back2 = wavfile.read(io.BytesIO(data))
    assert rate2 == 16000 and np.array_equal(back2, samples)


async def test_first_dialect_recorded_and_replayed(stack, record_dir):
    from omnifabric.tools.client import run_session
    from omnifabric.tools.probe import read_wav_16k, split_units

    before = {p.name for p in record_dir.iterdir()}
    units = split_units(read_wav_16k(FIXTURE), 2)
    report = await run_session(f"{stack.url}?mode=audio", units, pace_s=0, dialect="first")
    assert report.closed_reason == "stopped" and report.session_id not in before
    folder = record_dir / report.session_id
    meta = _finished(folder)
    assert meta["dialect"] == "first" and meta["close_reason"] == "stopped"
    types = {json.loads(line)["event"]["type"] for line in open(folder / "events.jsonl")}
    assert {"session.update", "input_audio_buffer.append", "response.listen"} <= types
    replay = _cli("replay", str(folder), "--url", stack.url, "--fast")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "timeline: match" in replay.stdout and "text: match" in replay.stdout


def test_recording_failure_disables_the_recorder(tmp_path):
    from omnifabric.edge import events as ev
    from omnifabric.edge.recording import SessionRecorder

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rec = SessionRecorder(blocker, "rt_1_abc", "audio", "/v1/realtime?mode=audio&api_key=x")
    assert rec.query == {"mode": ["audio"]}  # secrets never reach meta.json
    rec.start(ev.InitCommand(dialect=ev.Dialect.CURRENT))  # cannot create the folder
    assert not rec.enabled
    rec.append(ev.AppendCommand(pcm=b"\0" * 64000), ev.Dialect.CURRENT)
    rec.outbound({"type": "session.closed"})
    rec.finish()


def test_a_half_duplex_turn_records_the_units_heard_together(tmp_path):
    """A slow engine hears a call's waiting chunks as one unit (the others get no result of
    their own): the turn's user audio still holds all of them."""
    import json

    from omnifabric.edge import events as ev
    from omnifabric.edge.recording import SessionRecorder

    rec = SessionRecorder(tmp_path, "hdx_1", "audio", "/ws/half_duplex/hdx_1")
    rec.start(ev.InitCommand(dialect=ev.Dialect.CURRENT))
    for _ in range(3):  # three half-second chunks
        rec.append(ev.AppendCommand(pcm=b"\0" * 32000), ev.Dialect.CURRENT)
    usage = ev.Usage()
    rec.output(ev.Output(3, False, "Paris.", b"\0" * 9600, True, 10, {}, usage))
    rec.finish()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    turns = json.loads((folder / "recording.json").read_text())["turns"]
    assert [t["input"]["duration_ms"] for t in turns] == [1500]
    assert turns[0]["output"]["text"] == "Paris."
