"""Apps on and off at run time (/api/apps, /api/admin/apps): a switched-off app refuses new
sessions on its endpoints with a clear error, the others go on, and switching it back on
takes effect at once."""

from __future__ import annotations

import pytest
from websockets.exceptions import ConnectionClosed

from tests.e2e.test_default_voice import http_url
from tests.e2e.test_queue_api import ADMIN, USER, open_client
from tests.e2e.wsclient import WsClient
from tests.edge.test_voices import request
from tests.stack import keyed_stack


@pytest.fixture
def stack(tmp_path):
    stack = keyed_stack(tmp_path, f"{USER}\n{ADMIN} admin\n")
    yield stack
    stack.stop()


async def refused(client: WsClient) -> tuple[dict, int]:
    err = await client.until("error")
    with pytest.raises(ConnectionClosed) as info:
        while True:
            await client.recv()
    return err["error"], info.value.rcvd.code


async def test_switch_an_app_off_and_on(stack):
    apps_url = http_url(stack.url, "/api/apps")
    admin_url = http_url(stack.url, "/api/admin/apps")
    status, body = request(apps_url, "GET")  # public: the pages read it
    assert status == 200
    assert [a["app_id"] for a in body["apps"]] == [
        "turnbased",
        "omni",
        "audio_duplex",
        "half_duplex_audio",
    ]
    assert body["apps"][1] == {
        "app_id": "omni",
        "name": "Omni full-duplex (video)",
        "route": "/video",
    }

    assert request(admin_url, "GET", key=USER)[0] == 403
    status, body = request(admin_url, "GET", key=ADMIN)
    assert status == 200 and all(a["enabled"] for a in body["apps"])
    assert request(f"{admin_url}/omni", "PUT", {"enabled": False}, key=USER)[0] == 403
    status, body = request(f"{admin_url}/omni", "PUT", {"enabled": False}, key=ADMIN)
    assert status == 200 and body == {
        "success": True,
        "app": {
            "app_id": "omni",
            "name": "Omni full-duplex (video)",
            "route": "/video",
            "enabled": False,
        },
    }
    assert [a["app_id"] for a in request(apps_url, "GET")[1]["apps"]] == [
        "turnbased",
        "audio_duplex",
        "half_duplex_audio",
    ]

    video = await WsClient.open(
        f"{stack.url}?mode=video", additional_headers={"Authorization": f"Bearer {USER}"}
    )
    error, code = await refused(video)
    assert (error["code"], code) == ("app_disabled", 1008) and "video" in error["message"]
    audio = await open_client(stack, USER)  # another app goes on
    await audio.start()
    await audio.close()

    request(f"{admin_url}/turnbased", "PUT", {"enabled": False}, key=ADMIN)
    chat_url = http_url(stack.url, "/api/chat")
    status, body = request(
        chat_url, "POST", {"messages": [{"role": "user", "content": "hi"}]}, USER
    )
    assert status == 403 and body["error"] == "app_disabled"

    request(f"{admin_url}/omni", "PUT", {"enabled": True}, key=ADMIN)
    video = await WsClient.open(
        f"{stack.url}?mode=video", additional_headers={"Authorization": f"Bearer {USER}"}
    )
    await video.start()
    await video.close()

    assert request(f"{admin_url}/karaoke", "PUT", {"enabled": True}, key=ADMIN)[0] == 404
    assert request(f"{admin_url}/omni", "PUT", {"enabled": "yes"}, key=ADMIN)[0] == 400
    assert request(f"{admin_url}/omni", "DELETE", key=ADMIN)[0] == 405
