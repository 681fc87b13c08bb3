"""The queue and its estimate over HTTP, as the reference server offers them: GET /api/queue,
GET|DELETE /api/queue/{ticket}, GET|PUT /api/config/eta; reading needs a key, changing an
admin key; a cancelled client hears why and is closed."""

from __future__ import annotations

import pytest
from websockets.exceptions import ConnectionClosed

from tests.e2e.test_default_voice import http_url
from tests.e2e.wsclient import WsClient
from tests.edge.test_voices import request

USER, ADMIN = "sk-user", "sk-admin"


@pytest.fixture
def keyed_stack(stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{USER}\n{ADMIN} admin\n")
    stack.start_scheduler("--queue-update-interval", "0.2")
    stack.start_worker("--slots", "1", "--compute-ms", "5")
    stack.start_edge("--api-keys-file", str(keys))
    return stack


async def open_client(stack, key):
    return await WsClient.open(
        f"{stack.url}?mode=audio", additional_headers={"Authorization": f"Bearer {key}"}
    )


async def test_queue_listing_ticket_and_cancel(keyed_stack):
    stack = keyed_stack
    holder = await open_client(stack, USER)
    await holder.start()
    waiting = await open_client(stack, USER)
    queued = await waiting.until("session.queued")
    ticket = queued["ticket_id"]
    url = http_url(stack.url, "/api/queue")

    assert request(url, "GET")[0] == 401
    status, body = request(url, "GET", key=USER)
    assert status == 200 and body["queue_length"] == 1 and body["max_queue_size"] >= 1
    (item,) = body["items"]
    assert (item["ticket_id"], item["request_type"], item["position"]) == (
        ticket,
        "audio_duplex",
        1,
    )
    assert item["wait_elapsed_s"] >= 0 and item["enqueued_at"].endswith("+00:00")
    (running,) = body["running_tasks"]
    assert running["request_type"] == "audio_duplex" and running["elapsed_s"] >= 0

    status, body = request(f"{url}/{ticket}", "GET", key=USER)
    assert status == 200 and body["found"] and body["ticket"]["position"] == 1
    assert request(f"{url}/unknown", "GET", key=USER)[1]["found"] is False

    status, body = request(f"{url}/{ticket}", "DELETE", key=USER)
    assert status == 403 and body["error"] == "forbidden"
    status, body = request(f"{url}/{ticket}", "DELETE", key=ADMIN)
    assert status == 200 and body == {"success": True}
    err = await waiting.until("error")
    assert err["error"]["code"] == "cancelled"
    with pytest.raises(ConnectionClosed) as info:
        while True:
            await waiting.recv()
    assert info.value.rcvd.code == 1000
    assert request(f"{url}/{ticket}", "DELETE", key=ADMIN)[1] == {"success": False}
    assert request(url, "GET", key=USER)[1]["queue_length"] == 0
    await holder.close()


async def test_eta_read_and_changed_at_run_time(keyed_stack):
    stack = keyed_stack
    url = http_url(stack.url, "/api/config/eta")
    status, body = request(url, "GET", key=USER)
    assert status == 200 and body["ema_alpha"] == pytest.approx(0.2)
    assert body["config"]["eta_audio_duplex_s"] == 60.0 and body["ema_audio_duplex_samples"] == 0

    change = {"eta_audio_duplex_s": 9.0, "eta_chat_s": 4.0, "ema_alpha": 0.5}
    assert request(url, "PUT", change, key=USER)[0] == 403
    status, body = request(url, "PUT", change, key=ADMIN)
    assert status == 200 and body["ema_alpha"] == 0.5
    assert (body["config"]["eta_audio_duplex_s"], body["config"]["eta_chat_s"]) == (9.0, 4.0)
    assert body["config"]["eta_omni_duplex_s"] == 60.0  # not named: unchanged

    holder = await open_client(stack, USER)
    await holder.start()
    waiting = await open_client(stack, USER)
    queued = await waiting.until("session.queued")
    assert queued["estimated_wait_s"] == pytest.approx(9.0)  # the new baseline

    for bad, word in (
        ({"ema_alpha": 2.0}, "alpha"),
        ({"eta_chat_s": -1}, "eta_chat_s"),
        ({"eta_chat_s": "soon"}, "eta_chat_s"),
        ({"speed": 1}, "speed"),
    ):
        status, body = request(url, "PUT", bad, key=ADMIN)
        assert status == 400 and word in body["message"], body
    assert request(url, "GET", key=USER)[1]["ema_alpha"] == 0.5
    await waiting.close()
    await holder.close()
