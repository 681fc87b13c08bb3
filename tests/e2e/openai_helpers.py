"""What the OpenAI Realtime tests share: the weather function they offer, and reading a
connection's events until one of some kinds (the `openai` SDK's realtime connection)."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import scaled

#: The function the tests offer: get_weather(city), as the API's session.tools writes it.
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


async def until(
    conn: Any,
    *kinds: str,
    timeout_s: float = 30.0,
    seen: list | None = None,
    fail_on_error: bool = False,
) -> Any:
    """The next event of one of `kinds`, within `timeout_s` (scaled) in all; every event
    read is kept in `seen`. With `fail_on_error`, an `error` event read on the way fails
    the test (with the error), as in the real-model tests where none is expected."""

    async def read() -> Any:
        while True:
            event = await conn.recv()
            if seen is not None:
                seen.append(event)
            assert not (fail_on_error and event.type == "error"), event.error
            if event.type in kinds:
                return event

    return await asyncio.wait_for(read(), scaled(timeout_s))
