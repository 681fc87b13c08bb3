"""Apps on and off at run time (/api/apps, /api/admin/apps): a switched-off app refuses new
sessions on its endpoints with a clear error, the others go on, and switching it back on
takes effect at once."""

from __future__ import annotations

import asyncio

import pytest
from websockets.exceptions import ConnectionClosed

from tests.conftest import scaled
from tests.e2e.test_default_voice import http_url
from tests.e2e.test_queue_api import ADMIN, USER, open_client
from tests.e2e.wsclient import WsClient, wait_for
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


@pytest.mark.ci_long  # three edges started and switched: ~5 s (tests/conftest.py)
async def test_a_switch_reaches_every_edge_of_the_fabric(stack, tmp_path):
    first_url = stack.url
    # A second edge process on the same scheduler (another host of the fleet, or another
    # process of `edge --processes`).
    stack.start_edge("--api-keys-file", str(tmp_path / "keys"), name="edge2")
    second_url = stack.url
    admin = http_url(first_url, "/api/admin/apps")
    assert request(f"{admin}/audio_duplex", "PUT", {"enabled": False}, key=ADMIN)[0] == 200

    async def second_refuses() -> bool:
        apps = request(http_url(second_url, "/api/apps"), "GET")[1]["apps"]
        return "audio_duplex" not in [a["app_id"] for a in apps]

    took = await wait_for(second_refuses, 5, interval_s=0.1)
    assert took < scaled(2.5)  # read about once a second
    client = await WsClient.open(
        f"{second_url}?mode=audio", additional_headers={"Authorization": f"Bearer {USER}"}
    )
    error, code = await refused(client)
    assert (error["code"], code) == ("app_disabled", 1008)
    # Back on from the second edge: the first takes it.
    assert (
        request(
            f"{http_url(second_url, '/api/admin/apps')}/audio_duplex",
            "PUT",
            {"enabled": True},
            key=ADMIN,
        )[0]
        == 200
    )

    async def first_takes() -> bool:
        apps = request(http_url(first_url, "/api/apps"), "GET")[1]["apps"]
        return "audio_duplex" in [a["app_id"] for a in apps]

    await wait_for(first_takes, 5, interval_s=0.1)
    # Without the scheduler a switch cannot be made fabric-wide: 503, the state stays.
    assert request(f"{admin}/omni", "PUT", {"enabled": False}, key=ADMIN)[0] == 200
    stack.services[0].stop()
    status, body = request(f"{admin}/turnbased", "PUT", {"enabled": False}, key=ADMIN)
    assert status == 503 and body["error"] == "service_unavailable", body

    def enabled(url: str) -> list[str]:
        return [a["app_id"] for a in request(http_url(url, "/api/apps"), "GET")[1]["apps"]]

    assert "omni" not in enabled(first_url) and "turnbased" in enabled(first_url)
    # A restarted scheduler knows no switches: the edges give it theirs back (omni stays
    # off everywhere), and take its next change though it counts from 0 again.
    stack.restart_scheduler()
    await wait_for(lambda: asyncio.sleep(0, _scheduler_off(stack) == ["omni"]), 10, 0.2)
    for url in (first_url, second_url):  # the second may not have read it before the stop
        await wait_for(lambda u=url: asyncio.sleep(0, "omni" not in enabled(u)), 5, 0.1)
        assert "turnbased" in enabled(url)
    assert request(f"{admin}/omni", "PUT", {"enabled": True}, key=ADMIN)[0] == 200
    await wait_for(lambda: asyncio.sleep(0, "omni" in enabled(second_url)), 5, interval_s=0.1)
    await asyncio.sleep(1.5)  # a read or two later: not switched off again
    assert "omni" in enabled(second_url) and _scheduler_off(stack) == []


def _scheduler_off(stack) -> list[str] | None:
    """The apps the scheduler has off (GetApps), None when it does not answer."""
    import grpc

    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        try:
            reply = stub.GetApps(scheduler_pb.GetAppsRequest(), timeout=2)
        except grpc.RpcError:
            return None
    return list(reply.switches.disabled_app_ids)
