"""Follow-up requests and the reference engine's function checks ("What's the weather in
Paris?" then "And in London?"): the turns before a request, given to ``functions.choose``
and ``functions.fill`` (``recent``), make a follow-up's call, and leave a follow-up that
needs no function without one (worker/engines/reference/functions.py)."""

from __future__ import annotations

import json

import pytest

from omnifabric.common.tools import REQUIRED
from omnifabric.worker.engine import ChatMessage, ChatTurn, ToolCall, ToolChoice
from omnifabric.worker.engines.reference import functions
from tests.worker.reference.test_tools import BOOKING, ORDERS, TOOLS, WEATHER, Scripted, user

PARIS = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
#: A chat turn's messages after the weather in Paris was asked for, called and answered.
AFTER_PARIS = (
    ChatMessage("system", ("Be brief.",)),
    user("What's the weather in Paris?"),
    ChatMessage("assistant", (), (PARIS,)),
    ChatMessage("tool", ('{"temperature_c": 17, "conditions": "light rain"}',), (), "call_1"),
    ChatMessage("assistant", ("It is 17 degrees and raining lightly in Paris.",)),
)


def text_of(message: ChatMessage) -> str:
    return " ".join(p for p in message.parts if isinstance(p, str))


def follow_up(llm, request: str) -> functions.Plan:
    """The calls the reference check and arguments make for ``request`` after AFTER_PARIS."""
    messages = (*AFTER_PARIS, user(request))
    recent = functions.earlier_turns(messages, text_of)
    plan = functions.Plan()
    chosen = functions.choose(llm, functions.Offer(TOOLS), request, plan, recent)
    functions.fill_all(llm, request, chosen, plan, recent)
    return plan


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_and_in_london_after_paris_calls_get_weather_for_london(inline_engine) -> None:
    plan = follow_up(inline_engine.llm, "And in London?")
    (call,) = plan.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "London"}
    assert plan.problems == []


@pytest.mark.ci_long  # the real reply model: ~5 s each
@pytest.mark.parametrize("request_", ["Thanks, that's all.", "What is the capital of Spain?"])
def test_a_follow_up_that_needs_no_function_calls_none(inline_engine, request_: str) -> None:
    plan = follow_up(inline_engine.llm, request_)
    assert plan.calls == [] and plan.problems == []


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_a_new_request_after_a_call_calls_its_own_function(inline_engine) -> None:
    (call,) = follow_up(inline_engine.llm, "Where is my order 3120?").calls
    assert call.name == "order_status" and json.loads(call.arguments) == {"order_number": "3120"}


def test_earlier_turns_are_the_users_with_the_calls_they_got() -> None:
    messages = (
        *AFTER_PARIS,
        user("Thanks!"),
        ChatMessage("assistant", ("You're welcome.",)),
        user("And in London?"),
    )
    asked: list[ChatMessage] = []

    def transcribed(message: ChatMessage) -> str:
        asked.append(message)
        return text_of(message)

    older = (user("Hi"), ChatMessage("assistant", ("Hello.",)))
    assert functions.earlier_turns((*older, *messages), transcribed) == (
        functions.Earlier("What's the weather in Paris?", (PARIS,)),
        functions.Earlier("Thanks!"),
    )
    # Only the turns kept are transcribed (a chat turn's audio parts cost the recognizer).
    assert [text_of(m) for m in asked] == ["What's the weather in Paris?", "Thanks!"]
    assert functions.earlier_turns((user("Hi"),), text_of) == ()
    recent = functions.remembered((), "a", (PARIS,))
    recent = functions.remembered(functions.remembered(recent, "b"), "c")
    assert [t.said for t in recent] == ["b", "c"] == [t.said for t in recent[-2:]]


def test_without_recent_turns_the_questions_are_as_before() -> None:
    llm = Scripted("Yes", "No", "No", '"city": "Paris"}')
    plan = functions.Plan()
    chosen = functions.choose(llm, functions.Offer(TOOLS), "Weather in Paris?", plan, ())
    functions.fill_all(llm, "Weather in Paris?", chosen, plan)
    assert chosen == [WEATHER] and len(llm.asked) == 4
    assert llm.asked[0][-1][1] == (
        'The user said: "Weather in Paris?"\nDo they want you to get the current weather in a city?'
    )
    assert llm.asked[3][-1][1].endswith('}\nRequest: "Weather in Paris?"')


def test_a_function_called_before_is_asked_about_again_first() -> None:
    recent = (functions.Earlier("What's the weather in Paris?", (PARIS,)),)
    # A yes for get_weather once more: the lone checks are not asked.
    llm = Scripted("Yes", '"city": "London"}')
    plan = functions.Plan()
    chosen = functions.choose(llm, functions.Offer(TOOLS), "And in London?", plan, recent)
    functions.fill_all(llm, "And in London?", chosen, plan, recent)
    assert chosen == [WEATHER] and len(llm.asked) == 2
    assert llm.asked[0][-1][1] == (
        'The user said: "What\'s the weather in Paris?", and you did: get_weather({"city": '
        '"Paris"}).\nThen they said: "And in London?"\nDo they want you to get the current '
        "weather in a city once more, with other details they give?"
    )
    assert llm.asked[1][-1][1].endswith(
        "Earlier in the conversation:\n"
        'The user said: "What\'s the weather in Paris?"\n'
        'You called get_weather({"city": "Paris"}).\n'
        'Request: "And in London?"'
    )
    # A no: each function is asked about the request alone, as without recent turns.
    llm = Scripted("No", "No", "Yes", "No")
    chosen = functions.choose(llm, functions.Offer(TOOLS), "Book Nobu", functions.Plan(), recent)
    assert chosen == [BOOKING] and len(llm.asked) == 4
    assert llm.asked[1][-1][1].startswith('The user said: "Book Nobu"')


def test_required_picks_with_the_recent_turns_quoted() -> None:
    recent = (functions.Earlier("Where is my order 4410?"),)
    turn = ChatTurn(messages=(user("x"),), tools=TOOLS, tool_choice=ToolChoice(REQUIRED))
    llm = Scripted("No", "No", "No", "3")
    assert functions.choose(llm, turn, "x", functions.Plan(), recent) == [ORDERS]
    assert llm.asked[-1][-1][1].startswith(
        'Earlier in the conversation:\nThe user said: "Where is my order 4410?"\nThe user said'
    )
