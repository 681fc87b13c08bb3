"""The session recorder's bookkeeping, without a server."""

from __future__ import annotations

import json

import numpy as np

from omnifabric.edge import events as ev
from omnifabric.edge.recording import SessionRecorder


def output(seq: int, dropped: tuple[int, ...] = ()) -> ev.Output:
    return ev.Output(
        seq=seq,
        is_listen=True,
        text="",
        pcm=b"",
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
