"""Close every WebSocket client a test opened, so servers never wait on a dead loop."""

from __future__ import annotations

import pytest

from tests.e2e.wsclient import WsClient


@pytest.fixture(autouse=True)
async def _close_clients(request):
    if "stack" in request.fixturenames:
        request.getfixturevalue("stack")  # set up first, so torn down after the clients close
    yield
    clients, WsClient.opened[:] = list(WsClient.opened), []
    for client in clients:
        try:
            await client.ws.close()
        except Exception:
            pass
