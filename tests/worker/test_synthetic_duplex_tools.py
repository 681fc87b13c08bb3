"""The synthetic engine's duplex sessions call functions (issue 53): offered tools make
each user turn's reply a call, the call's output the spoken reply that follows."""

from __future__ import annotations

import numpy as np

from omnifabric.common.tools import FUNCTION, NONE, ToolChoice, ToolSpec
from omnifabric.worker.engine import DuplexSettings
from omnifabric.worker.engines.synthetic import SyntheticEngine

SPEECH = (0.3 * np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)).astype(np.float32)
SILENCE = np.zeros(16000, dtype=np.float32)
WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = ToolSpec("get_time", "The time now.", {"type": "object", "properties": {}})


class Session:
    def __init__(self, tools=(WEATHER,), choice: ToolChoice | None = None) -> None:
        self.session = SyntheticEngine(compute_ms=0).open_session("s-1", "audio")
        self.session.prepare("", None, None, DuplexSettings(force_listen_count=0))
        self.notes = self.session.offer_tools(tuple(tools), choice or ToolChoice())

    def unit(self, pcm):
        self.session.prefill(pcm, [], 1)
        result = self.session.generate(False)
        self.session.finalize()
        return result


def test_a_turns_reply_is_a_call_and_its_output_the_spoken_reply():
    s = Session()
    assert s.notes == ()  # it calls: no note that it cannot
    results = [s.unit(u) for u in (SPEECH, SILENCE, SILENCE)]
    called = [r for r in results if r.tool_calls]
    assert len(called) == 1 and called[0].is_listen and called[0].end_of_turn
    (call,) = called[0].tool_calls
    assert call.name == "get_weather" and call.arguments == '{"city": "synthetic"}'
    assert all(r.is_listen for r in (s.unit(SILENCE), s.unit(SILENCE)))  # it waits
    s.session.tool_output("call_other", "ignored")  # not the call it waits for
    assert s.unit(SILENCE).is_listen
    s.session.tool_output(call.call_id, "cloudy")
    reply = s.unit(SILENCE)
    assert not reply.is_listen and reply.text.startswith("The result: cloudy")


def test_a_named_function_is_the_one_called_and_none_calls_nothing():
    named = Session((WEATHER, CLOCK), ToolChoice(FUNCTION, "get_time"))
    results = [named.unit(u) for u in (SPEECH, SILENCE, SILENCE)]
    assert [c.name for r in results for c in r.tool_calls] == ["get_time"]
    plain = Session((WEATHER,), ToolChoice(NONE))
    results = [plain.unit(u) for u in (SPEECH, SILENCE, SILENCE)]
    assert not any(r.tool_calls for r in results)
    assert any(not r.is_listen for r in results)  # it speaks a reply of its own
