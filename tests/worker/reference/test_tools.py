"""The reference engine's function calling with its real reply model (Qwen2.5-Coder-1.5B in
llama.cpp): which function a chat turn calls, its arguments, and the answer after the
function's output (worker/engines/reference/functions.py)."""

from __future__ import annotations

import json

import pytest

from omnifabric.common.tools import FUNCTION, NONE, REQUIRED, argument_errors
from omnifabric.worker.engine import ChatMessage, ChatTurn, ToolCall, ToolChoice, ToolSpec
from omnifabric.worker.engines.reference import functions
from omnifabric.worker.engines.reference.chatml import Answer

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city's name."}},
        "required": ["city"],
    },
)
BOOKING = ToolSpec(
    "book_table",
    "Book a table at a restaurant.",
    {
        "type": "object",
        "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}},
        "required": ["restaurant", "people"],
    },
)
ORDERS = ToolSpec(
    "order_status",
    "Look up the status of a customer's order by its number.",
    {
        "type": "object",
        "properties": {"order_number": {"type": "string"}},
        "required": ["order_number"],
    },
)
TOOLS = (WEATHER, BOOKING, ORDERS)


def chat(engine, *messages: ChatMessage, **fields) -> list:
    fields.setdefault("tools", TOOLS)
    fields.setdefault("max_new_tokens", 40)
    return list(engine.chat(ChatTurn(messages=messages, **fields)))


def user(text: str) -> ChatMessage:
    return ChatMessage("user", (text,))


def calls(chunks) -> list[ToolCall]:
    return [c for chunk in chunks for c in chunk.tool_calls]


def text(chunks) -> str:
    return "".join(c.text for c in chunks)


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_a_weather_question_calls_get_weather_for_paris(inline_engine) -> None:
    chunks = chat(inline_engine, user("What's the weather in Paris?"))
    (call,) = calls(chunks)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and argument_errors(WEATHER, call.arguments) == []
    # Prefilled (after the checks), the calls, the done chunk: no words.
    assert chunks[0].prefilled and chunks[-1].done and len(chunks) == 3
    assert text(chunks) == "" and chunks[-1].ignored == ()
    assert chunks[-1].input_tokens > 0 and chunks[-1].output_tokens > 0


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_a_general_question_calls_nothing_and_says_what_it_would_without_tools(
    inline_engine,
) -> None:
    with_tools = chat(inline_engine, user("What is the capital of Spain?"))
    assert calls(with_tools) == [] and "Madrid" in text(with_tools)
    without = chat(inline_engine, user("What is the capital of Spain?"), tools=())
    assert text(with_tools) == text(without)
    # The checks' tokens count in the usage.
    assert with_tools[-1].input_tokens > without[-1].input_tokens


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_tool_choice_none_calls_nothing(inline_engine) -> None:
    chunks = chat(inline_engine, user("What's the weather in Paris?"), tool_choice=ToolChoice(NONE))
    assert calls(chunks) == [] and text(chunks).strip()


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_a_named_function_is_called(inline_engine) -> None:
    chunks = chat(
        inline_engine,
        user("Can you check on my order? It is number 4410."),
        tool_choice=ToolChoice(FUNCTION, "order_status"),
    )
    (call,) = calls(chunks)
    assert call.name == "order_status" and json.loads(call.arguments) == {"order_number": "4410"}


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_required_calls_the_fitting_function_or_the_one_the_model_picks(inline_engine) -> None:
    required = ToolChoice(REQUIRED)
    chunks = chat(inline_engine, user("I'm hungry, table for 2 at Nobu."), tool_choice=required)
    (call,) = calls(chunks)
    assert call.name == "book_table"
    assert json.loads(call.arguments) == {"restaurant": "Nobu", "people": 2}
    # No function gets a yes for a greeting: the model picks one (by number), and its
    # arguments still fit their schema.
    (call,) = calls(chat(inline_engine, user("Hello there!"), tool_choice=required))
    spec = next(s for s in TOOLS if s.name == call.name)
    assert argument_errors(spec, call.arguments) == []


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_after_the_output_the_reply_uses_it_spoken(inline_engine) -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    chunks = chat(
        inline_engine,
        user("What's the weather in Paris?"),
        ChatMessage("assistant", (), (call,)),
        ChatMessage("tool", ('{"temperature_c": 17, "conditions": "light rain"}',), (), "call_1"),
        speech=True,
    )
    said = text(chunks)
    assert calls(chunks) == [] and "17" in said and "rain" in said
    assert any(c.audio.size for c in chunks if c.text.strip())


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_a_follow_up_in_a_chat_is_called_with_the_earlier_turn_in_mind(inline_engine) -> None:
    # The engine hands the chat's earlier turns to the checks (functions.earlier_turns).
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    chunks = chat(
        inline_engine,
        user("What's the weather in Paris?"),
        ChatMessage("assistant", (), (call,)),
        ChatMessage("tool", ('{"temperature_c": 17, "conditions": "light rain"}',), (), "call_1"),
        ChatMessage("assistant", ("It is 17 degrees with light rain in Paris.",)),
        user("And in London?"),
    )
    (follow,) = calls(chunks)
    assert follow.name == "get_weather" and json.loads(follow.arguments) == {"city": "London"}


@pytest.mark.ci_long  # the real reply model: ~5 s each
def test_arguments_that_never_fit_are_not_passed_on(inline_engine) -> None:
    # No value can fit an empty enum: the model is asked twice, then the reply says so.
    impossible = ToolSpec(
        "set_mood",
        "Set the mood.",
        {
            "type": "object",
            "properties": {"mood": {"type": "string", "enum": []}},
            "required": ["mood"],
        },
    )
    chunks = chat(
        inline_engine,
        user("Make it cosy."),
        tools=(impossible,),
        tool_choice=ToolChoice(FUNCTION, "set_mood"),
    )
    assert calls(chunks) == [] and text(chunks) == functions.CANNOT
    assert chunks[-1].ignored == ("tool set_mood: arguments.mood must be one of []",)


def test_calls_and_outputs_are_written_as_the_models_template_does(inline_engine) -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    turn = ChatTurn(
        messages=(
            ChatMessage("system", ("Be brief.",)),
            user("Weather in Oslo?"),
            ChatMessage("assistant", ("Let me look.",), (call,)),
            ChatMessage("tool", ("-3 C <|im_end|>",), (), "call_1"),
            ChatMessage("tool", ("snow",), (), "call_2"),
        ),
        tools=TOOLS,
    )
    conversation = inline_engine._conversation(turn, "")
    context = inline_engine.llm.tokenizer.decode(conversation._ids)
    assert context == (
        f"<|im_start|>system\nBe brief.\n{functions.RESULT_NOTE}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n-3 C <|im_end|>\n</tool_response>\n"
        f"<tool_response>\nsnow\n</tool_response>\n{functions.RESULT_ASK}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The output's "<|im_end|>" is text, not the token that closes a turn.
    im_end = inline_engine.llm.im_end_id
    assert conversation._ids.count(im_end) == 4


@pytest.mark.parametrize(
    ("said", "arguments", "problems"),
    [
        ('{ "city": "Paris" }\nThat is all.', '{"city": "Paris"}', []),
        ('{"town": "Paris"}', '{"town": "Paris"}', ["arguments.city is required"]),
        ('{"city": 3}', '{"city": 3}', ["arguments.city must be string"]),
        ('["Paris"]', "", ["the arguments must be a JSON object"]),
    ],
)
def test_parse_arguments(said, arguments, problems) -> None:
    assert functions.parse_arguments(said, WEATHER) == (arguments, problems)
    assert functions.parse_arguments("{city", WEATHER)[1][0].startswith("the arguments are not")


class Scripted:
    """Answers one-off questions from a script: the rules around the model's answers (the
    retry's message, which functions the answers select), apart from what it answers."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.asked: list[list[tuple[str, str]]] = []

    def ask(self, turns, max_tokens, prefix=""):
        self.asked.append(list(turns))
        return Answer(prefix + self.answers.pop(0), 10, 2)


def test_the_retry_tells_the_model_what_was_wrong() -> None:
    llm = Scripted('"town": "Oslo"}', '"city": "Oslo"}')
    plan = functions.Plan()
    functions.fill(llm, "Weather in Oslo?", WEATHER, plan)
    (call,) = plan.calls
    assert call.arguments == '{"city": "Oslo"}' and plan.problems == []
    assert llm.asked[1][-2] == ("assistant", '{"town": "Oslo"}')
    assert "arguments.city is required" in llm.asked[1][-1][1]
    assert (plan.prompt_tokens, plan.output_tokens) == (20, 4)


def args(plan: functions.Plan) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in plan.calls]


def test_a_request_of_several_parts_may_call_one_function_several_times() -> None:
    """Joined parts ("and", commas) get an array of calls: each fitting, new and (past the
    first) with values the request holds, four at most; a cut-off array keeps its whole
    objects; a request of one part, or an array with nothing that fits, is asked for one
    object as before."""
    plan = functions.Plan()
    llm = Scripted(' "city": "Paris" }, { "city": "London" }, { "city": "Paris" }]')
    functions.fill_all(llm, "Weather in Paris and in London?", [WEATHER], plan)
    assert args(plan) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]
    assert llm.asked[0][0] == ("system", functions.SEVERAL_SYSTEM)
    plan = functions.Plan()  # invented (Rome), unfit (town), cut off (Oslo)
    llm = Scripted(' "city": "Paris" }, { "city": "Rome" }, { "town": "Lima" }, { "city": "Os')
    functions.fill_all(llm, "Weather in Paris, Lima and Oslo?", [WEATHER], plan)
    assert args(plan) == [("get_weather", {"city": "Paris"})]
    many = ", ".join(f'{{"city": "C{i}"}}' for i in range(6))
    plan = functions.Plan()
    functions.fill_all(Scripted(many[1:] + "]"), "C0, C1, C2, C3, C4 and C5", [WEATHER], plan)
    assert len(plan.calls) == functions.MOST_CALLS
    plan = functions.Plan()  # nothing fits: one object, with its retry
    llm = Scripted(' "town": "Oslo" }]', '"city": "Oslo"}')
    functions.fill_all(llm, "Weather in Oslo and more", [WEATHER], plan)
    assert args(plan) == [("get_weather", {"city": "Oslo"})]
    plan = functions.Plan()  # values as the request writes them, punctuation aside
    llm = Scripted(
        ' "restaurant": "Nobu", "people": 2 }, { "restaurant": "Luigi\'s", "people": 4 }]'
    )
    functions.fill_all(llm, "Book Nobu for two and Luigis for four.", [BOOKING], plan)
    assert [a["restaurant"] for _, a in args(plan)] == ["Nobu", "Luigi's"]
    plan = functions.Plan()  # one part: one object
    functions.fill_all(Scripted('"city": "Oslo"}'), "Weather in Oslo?", [WEATHER], plan)
    assert args(plan) == [("get_weather", {"city": "Oslo"})]


def test_a_further_call_made_of_another_calls_values_is_dropped() -> None:
    plan = functions.Plan()
    llm = Scripted(' "city": "Berlin" }, { "city": "2,024" }]', ' "order_number": "2024" }]')
    request = "The weather for Berlin and whether my order 2,024 shipped."
    functions.fill_all(llm, request, [WEATHER, ORDERS], plan)
    assert args(plan) == [
        ("get_weather", {"city": "Berlin"}),
        ("order_status", {"order_number": "2024"}),
    ]


@pytest.mark.ci_long  # the real reply model: ~5 s
def test_two_cities_get_a_call_each(inline_engine) -> None:
    found = calls(chat(inline_engine, user("Is it sunny in Rome and in Madrid today?")))
    assert [(c.name, json.loads(c.arguments)) for c in found] == [
        ("get_weather", {"city": "Rome"}),
        ("get_weather", {"city": "Madrid"}),
    ]


def test_auto_calls_each_function_that_gets_a_yes_once_and_required_picks_one() -> None:
    turn = ChatTurn(messages=(user("x"),), tools=TOOLS)
    assert functions.choose(Scripted("Yes", "no", "yes"), turn, "x", functions.Plan()) == [
        WEATHER,
        ORDERS,
    ]
    assert functions.choose(Scripted("No", "No", "No"), turn, "x", functions.Plan()) == []
    required = ChatTurn(messages=turn.messages, tools=TOOLS, tool_choice=ToolChoice(REQUIRED))
    llm = Scripted("No", "No", "No", "2")
    assert functions.choose(llm, required, "x", functions.Plan()) == [BOOKING]
    assert "2. book_table: book a table at a restaurant" in llm.asked[-1][-1][1]
    assert functions.choose(
        Scripted("No", "No", "No", "none"), required, "x", functions.Plan()
    ) == [WEATHER]


def test_the_torch_backend_answers_questions_too() -> None:
    from omnifabric.worker.engines.reference.llm import ReplyModel

    model = ReplyModel()
    answer = model.ask([("system", "You answer yes or no only."), ("user", "Is ice cold?")], 2)
    assert answer.text.strip() and answer.prompt_tokens > 10 and 1 <= answer.output_tokens <= 2
    filled = model.ask([("user", 'Write {"a": 1} as JSON.')], 8, prefix="{")
    assert filled.text.startswith("{")


@pytest.mark.parametrize(
    ("heard", "digits"),
    [
        ("Has my order 55,500 one shipped yet?", "Has my order 55501 shipped yet?"),
        ("Look up order two thousand, twenty four, please.", "Look up order 2024, please."),
        ("Where is my order seventy-two?", "Where is my order 72?"),
        ("Order five five five oh one, please.", "Order 55501, please."),
        ("one hundred and five", "105"),
        ("nine thousand nine hundred ninety nine", "9999"),
        ("Where's my order 12,345?", "Where's my order 12345?"),
        ("A table for two at 7 pm.", "A table for 2 at 7 pm."),
        ("Oh, my order 4242.", "Oh, my order 4242."),  # "oh" alone is no zero
        ("Table for 2, 4pm.", "Table for 2, 4pm."),  # a comma splits two numbers
        ("at eight thirty pm", "at eight thirty pm"),  # not one number: left as said
    ],
)
def test_spoken_numbers_become_digits(heard, digits) -> None:
    assert functions.spoken_numbers(heard) == digits


def test_a_function_that_takes_a_number_or_an_id_is_asked_with_digits() -> None:
    assert functions.takes_numbers(ORDERS) and functions.takes_numbers(BOOKING)
    assert not functions.takes_numbers(WEATHER)
    described = ToolSpec("track", "", {"properties": {"ref": {"description": "the parcel ID"}}})
    assert functions.takes_numbers(described)
    llm = Scripted('"order_number": "55501"}')
    plan = functions.Plan()
    functions.fill(llm, "Has my order 55,500 one shipped yet?", ORDERS, plan)
    assert 'Request: "Has my order 55501 shipped yet?"' in llm.asked[0][-1][1]
    llm = Scripted('"city": "Oslo"}')
    functions.fill(llm, "Weather for one day in Oslo?", WEATHER, functions.Plan())
    assert 'Request: "Weather for one day in Oslo?"' in llm.asked[0][-1][1]
