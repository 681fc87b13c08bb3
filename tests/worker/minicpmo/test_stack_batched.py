"""`omnifabric serve --engine minicpmo --slots 4 --device cpu` on the tiny checkpoint (opt-in):
four sessions at once, served in batched steps, give per unit what each gives alone, and
the worker's batch histogram shows steps of several sessions."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import numpy as np
import pytest

from tests.conftest import scaled
from tests.e2e.wsclient import WsClient
from tests.stack import read_until_line
from tests.worker.minicpmo.conftest import LAYOUTS, needs_code, tiny_serve

pytestmark = [needs_code, pytest.mark.timeout(900)]

SESSIONS = 4
UNITS = 6


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
