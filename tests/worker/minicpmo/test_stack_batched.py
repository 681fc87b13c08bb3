"""`omnifabric serve --engine minicpmo --slots 4 --device cpu` on the tiny checkpoint (opt-in):
four sessions at once, served in batched steps, give per unit what each gives alone, and
the worker's batch histogram shows steps of several sessions; four callers at once hear
speech (the tiny random vocoder) on every unit the model speaks."""

from __future__ import annotations

import asyncio
import base64
import re
import urllib.request
from typing import Any

import numpy as np
import pytest

from tests.conftest import scaled
from tests.e2e.wsclient import WsClient
from tests.stack import read_until_line
from tests.worker.minicpmo.conftest import LAYOUTS, needs_code, tiny_serve

pytestmark = [needs_code, pytest.mark.timeout(900)]

SESSIONS = 4
UNITS = 6
#: Units of each caller in the speech test (the model's first 3 units always listen).
SPEECH_UNITS = 10


@pytest.fixture(scope="module", params=[layout for layout, _ in LAYOUTS] or ["none"])
def served(request, tiny_dirs):
    """(edge URL, the worker's /metrics URL)."""
    layout = request.param
    code = dict(LAYOUTS)[layout]
    # Admission by slots alone: the tiny checkpoint on CPU is not the point here.
    env = {"OMNI_SCHEDULER_REALTIME_MARGIN": "0"}
    with tiny_serve(tiny_dirs[code], layout, "--slots", str(SESSIONS), env=env) as (proc, url):
        line = read_until_line(proc, "omnifabric metrics: ", timeout_s=scaled(30))
        metrics = next(w.split("=", 1)[1] for w in line.split()[2:] if w.startswith("worker"))
        yield url, metrics


async def _session(url: str, index: int) -> list[tuple[str, str]]:
    """One greedy session of UNITS seconds of its own noise, unit by unit (each after the
    previous result): per unit, its kind and text."""
    client = await WsClient.open(f"{url}?mode=audio", subprotocols=["map.realtime"])
    await client.until("session.queue_done", timeout_s=scaled(300))
    prompt = f"You are assistant number {index}. Be brief."
    config = {"temperature": 0, "force_listen_count": 0}
    await client.send(
        {"type": "session.init", "payload": {"system_prompt": prompt, "config": config}}
    )
    await client.until("session.created", timeout_s=scaled(120))
    rng = np.random.default_rng(100 + index)
    units = []
    for _ in range(UNITS):
        pcm = ((0.02 + 0.02 * index) * rng.standard_normal(16000)).astype(np.float32)
        await client.append(pcm)
        event = await client.until("response.output.delta", timeout_s=scaled(120))
        units.append((str(event.get("kind")), str(event.get("text", ""))))
    await client.send({"type": "session.close", "payload": {"reason": "user_stop"}})
    await client.until("session.closed", timeout_s=scaled(60))
    await client.close()
    assert not [e for e in client.events if e["type"] == "error"], client.events
    return units


def _batch_counts(metrics_url: str) -> dict[float, float]:
    """omni_worker_batch_sessions: cumulative step counts by bucket bound."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {}
    for match in re.finditer(r'omni_worker_batch_sessions_bucket\{le="([^"]+)"\} (\S+)', text):
        counts[float(match.group(1))] = float(match.group(2))
    return counts


def test_four_batched_sessions_give_per_unit_what_each_gives_alone(served):
    url, metrics = served
    alone = [asyncio.run(_session(url, i)) for i in range(SESSIONS)]
    before = _batch_counts(metrics)

    async def together():
        return await asyncio.gather(*(_session(url, i) for i in range(SESSIONS)))

    batched = asyncio.run(together())
    after = _batch_counts(metrics)
    for i in range(SESSIONS):
        assert batched[i] == alone[i], (i, alone[i], batched[i])
    # Steps of more than one session happened while the four ran together.
    single = after.get(1.0, 0.0) - before.get(1.0, 0.0)
    every = after[float("inf")] - before.get(float("inf"), 0.0)
    assert every - single > 0, (before, after)
    kinds = {kind for units in alone for kind, _ in units}
    several = every - single
    print(f"unit kinds seen: {sorted(kinds)}; steps {every:.0f}, of several sessions {several:.0f}")


async def _speaking_session(url: str, index: int) -> dict[str, Any]:
    """One sampling session of SPEECH_UNITS seconds of its own noise, unit by unit; its
    deltas grouped by unit (input_id), the close event and the errors."""
    client = await WsClient.open(f"{url}?mode=audio", subprotocols=["map.realtime"])
    await client.until("session.queue_done", timeout_s=scaled(300))
    config = {"temperature": 0.9, "force_listen_count": 0, "seed": 40 + index}
    await client.send(
        {"type": "session.init", "payload": {"system_prompt": f"Talk #{index}.", "config": config}}
    )
    await client.until("session.created", timeout_s=scaled(120))
    rng = np.random.default_rng(300 + index)
    for k in range(SPEECH_UNITS):
        pcm = ((0.02 + 0.02 * index) * rng.standard_normal(16000)).astype(np.float32)
        await client.append(pcm)
        while not any(e.get("input_id") == f"input_{k + 1}" for e in client.events):
            await client.until("response.output.delta", "error", timeout_s=scaled(120))
    await client.send({"type": "session.close", "payload": {"reason": "user_stop"}})
    closed = await client.until("session.closed", timeout_s=scaled(60))
    await client.close()
    units: dict[str, list[dict[str, Any]]] = {}
    for e in client.events:
        if e["type"] == "response.output.delta":
            units.setdefault(e["input_id"], []).append(e)
    errors = [e for e in client.events if e["type"] == "error"]
    return {"units": units, "closed": closed, "errors": errors}


def test_four_callers_hear_speech_on_every_speaking_unit(served):
    """Four callers at once on the batched worker: every unit that speaks carries audio, 1 s
    of it per speaking unit (within 10% over the session), no errors, and the worker's
    vocoder caches go with the sessions."""
    url, metrics = served

    async def together():
        return await asyncio.gather(*(_speaking_session(url, i) for i in range(SESSIONS)))

    calls = asyncio.run(together())
    spoken = 0
    for i, call in enumerate(calls):
        assert call["errors"] == [], (i, call["errors"])
        assert call["closed"]["reason"] == "user_stop"
        speaking = [u for u in call["units"].values() if any(e["kind"] != "listen" for e in u)]
        samples = 0
        for unit in speaking:
            audio = [e for e in unit if e["kind"] == "audio"]
            assert audio, (i, unit)  # no speaking unit without audio
            pcm = np.concatenate(
                [np.frombuffer(base64.b64decode(e["audio"]), dtype="<f4") for e in audio]
            )
            assert np.isfinite(pcm).all() and np.abs(pcm).max() <= 1.0
            samples += pcm.size
        if speaking:
            seconds = samples / 24000
            assert abs(seconds - len(speaking)) <= 0.1 * len(speaking), (i, seconds, speaking)
        spoken += len(speaking)
    assert spoken > 0
    print(f"speaking units: {spoken} of {SESSIONS * SPEECH_UNITS}")
