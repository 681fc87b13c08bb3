"""The session recorder's bookkeeping, without a server."""

from __future__ import annotations

import json

import numpy as np

from omnifabric.edge import events as ev
from omnifabric.edge.recording import SessionRecorder


def output(seq: int, dropped: tuple[int, ...] = (), pcm: bytes = b"") -> ev.Output:
    return ev.Output(
        seq=seq,
        is_listen=not pcm,
        text="",
        pcm=pcm,
        end_of_turn=False,
        kv_cache_length=0,
        timings_ms={},
        usage=ev.Usage(),
        dropped_seqs=dropped,
    )


def test_units_without_a_result_of_their_own_are_not_kept(tmp_path):
    """Full duplex drops the oldest waiting units (reported with the next result); their
    receive times must go with that result, not stay for the whole call."""
    recorder = SessionRecorder(tmp_path, "rt_test", "audio", "/v1/realtime?mode=audio")
    recorder.start(ev.InitCommand(ev.Dialect.CURRENT))
    unit = ev.AppendCommand(np.zeros(16000, dtype="<f4").tobytes())
    for _ in range(200):
        recorder.append(unit, ev.Dialect.CURRENT)
    # Every fourth unit is answered; the three before it were dropped.
    for seq in range(4, 201, 4):
        recorder.output(output(seq, dropped=(seq - 3, seq - 2, seq - 1)))
    assert recorder.enabled
    assert (len(recorder._received), len(recorder._received_ms)) == (0, 0)
    recorder.finish("w0")
    assert recorder.folder is not None
    units = [json.loads(line) for line in (recorder.folder / "units.jsonl").open()]
    assert [u["seq"] for u in units if u.get("kind") == "dropped"][:3] == [1, 2, 3]
    answered = [u for u in units if u.get("kind") == "listen"]
    assert len(answered) == 50 and all(u["edge_ms"] is not None for u in answered)


def test_each_audio_event_points_at_its_own_unit_in_model_wav(tmp_path):
    """An audio event is logged as a range of model.wav, looked up by its unit's seq; the
    recorder keeps that lookup for the latest speaking unit only, not one per unit."""
    recorder = SessionRecorder(tmp_path, "rt_test", "audio", "/v1/realtime?mode=audio")
    recorder.start(ev.InitCommand(ev.Dialect.CURRENT))
    unit = ev.AppendCommand(np.zeros(16000, dtype="<f4").tobytes())
    for seq in range(1, 101):
        recorder.append(unit, ev.Dialect.CURRENT)
        samples = 1000 + seq  # a different length per unit
        recorder.output(output(seq, pcm=np.zeros(samples, dtype="<f4").tobytes()))
        recorder.outbound(
            {"type": "response.output_audio.delta", "audio": "AAAA", "metrics": {"seq": seq}}
        )
    # An event for a unit that is not the latest one (none is sent that way) is not
    # given another unit's audio.
    recorder.outbound(
        {"type": "response.output_audio.delta", "audio": "AAAA", "metrics": {"seq": 3}}
    )
    assert recorder._model_ref == (100, sum(1000 + s for s in range(1, 100)), 1100)
    recorder.finish("w0")
    assert recorder.folder is not None
    sent = [json.loads(line) for line in (recorder.folder / "events.jsonl").open()]
    refs = [e["event"]["audio"] for e in sent if e["dir"] == "out"]
    assert len(refs) == 101
    assert [r.get("samples") for r in refs[:100]] == [1000 + s for s in range(1, 101)]
    assert [r.get("start") for r in refs[:3]] == [0, 1001, 2003]
    assert refs[100] == {"omitted_bytes": 3}


def test_the_timeline_is_spooled_not_kept(tmp_path):
    """recording.json's timeline goes to a spool file as the session runs (the recorder's
    memory does not grow with it); finish writes recording.json from the spool, the same
    entries in order, and removes the spool."""
    from omnifabric.edge.recording import TIMELINE_SPOOL

    recorder = SessionRecorder(tmp_path, "rt_long", "audio", "/v1/realtime?mode=audio")
    recorder.start(ev.InitCommand(ev.Dialect.CURRENT))
    unit = ev.AppendCommand(np.zeros(160, dtype="<f4").tobytes())
    for seq in range(1, 301):
        recorder.append(unit, ev.Dialect.CURRENT)
        pcm = np.zeros(240, dtype="<f4").tobytes() if seq % 3 == 0 else b""
        recorder.output(output(seq, pcm=pcm))
    assert recorder.folder is not None
    spool = recorder.folder / TIMELINE_SPOOL
    before = vars(recorder).copy()
    assert not any(isinstance(v, list) and len(v) >= 300 for v in before.values())
    recorder.finish("w0")
    assert not spool.exists()
    recording = json.loads((recorder.folder / "recording.json").read_text())
    assert list(recording) == ["session_id", "mode", "worker_id", "start_ts", "config", "chunks"]
    assert recording["worker_id"] == "w0" and recording["mode"] == "duplex"
    chunks = recording["chunks"]
    assert [c["index"] for c in chunks] == list(range(300))
    assert [c["result"]["mode"] for c in chunks[:3]] == ["LISTEN", "LISTEN", "SPEAK"]
    assert chunks[2]["result"]["ai_audio"] == "ai_audio/turn_0_chunk_000.wav"
