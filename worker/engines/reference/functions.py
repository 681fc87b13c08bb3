"""Function calling for the reference engine's reply model (a small ChatML model).

Offered its functions in the system prompt, Qwen2.5-Coder-1.5B calls one for almost any
question (get_weather for "What is the capital of Spain?"), so the choice and the arguments
are asked separately, as short questions the model answers well:

- whether to call: one yes/no question per function ("Do they want you to <what it
  does>?"), its first token only (auto: every function that gets a yes, once; required:
  those, else the one the model picks from a numbered list; a named function: that one);
- the arguments: a JSON object for the function's schema and the user's words, greedy, its
  answer begun with "{"; parsed and checked against the schema (common.tools), asked once
  more with what was wrong, and never passed on when it still does not fit. A request of
  joined parts ("Paris and London") is asked for a JSON array of them first: one call of
  the function per fitting object (``fill_several``: parallel calls).

A function's output goes back into the conversation as the model's template writes it: the
call as an assistant turn "<tool_call>{json}</tool_call>", the outputs as a user turn of
"<tool_response>" blocks (the tokenizer made from the GGUF has neither as a token of its own:
they are text, and the client's text cannot close a turn: ChatML.turn_ids). How calls and
outputs are written as text, and how arguments are read back, is worker/engines/tool_text.py
(shared with the minicpmo engine); the names engine.py uses are re-exported here (``x as x``).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from omnifabric.common.tools import AUTO, FUNCTION, REQUIRED
from omnifabric.worker.engine import ChatMessage, ToolCall, ToolChoice, ToolSpec
from omnifabric.worker.engines.reference.chatml import Answer
from omnifabric.worker.engines.tool_text import CANNOT as CANNOT
from omnifabric.worker.engines.tool_text import RESULT_OPEN as RESULT_OPEN
from omnifabric.worker.engines.tool_text import calls_text as calls_text
from omnifabric.worker.engines.tool_text import parse_arguments as parse_arguments
from omnifabric.worker.engines.tool_text import results_text as results_text

#: The yes/no question: what the model does when asked whether a request wants a function.
CHECK_SYSTEM = "You answer yes or no only."
CHECK_QUESTION = 'The user said: "{request}"\nDo they want you to {task}?'
#: After a call, whether the request asks for it again with other details ("And in
#: London?" after get_weather for Paris), asked before CHECK_QUESTION (``continued``).
AGAIN_QUESTION = (
    'The user said: "{said}", and you did: {call}.\nThen they said: "{request}"\n'
    "Do they want you to {task} once more, with other details they give?"
)
#: required, when no function got a yes: the model picks one by its number.
PICK_SYSTEM = "You pick the one function that best serves a request. Answer with its number only."
PICK_QUESTION = '{earlier}The user said: "{request}"\nFunctions:\n{functions}\nWhich number?'
#: The arguments, as one JSON object.
FILL_SYSTEM = (
    "You fill in a function's arguments. Write one JSON object that fits the function's "
    "schema, with values taken from the request, and nothing else."
)
FILL_QUESTION = (
    "Function: {name}\nWhat it does: {description}\nSchema of its arguments: {schema}\n"
    '{earlier}Request: "{request}"'
)
FILL_RETRY = "That does not fit the schema: {problems}. Write the corrected JSON object only."
ARGUMENT_TOKENS = 160
#: A request that may ask for one function several times ("the weather in Paris and in
#: London", "orders 4242 and 31337") joins its parts with one of these; only such a request
#: is asked for a JSON array of calls (``fill_several``), any other for one object as before.
SEVERAL_WORDS = re.compile(r"\b(?:and|or|both|each|also)\b|[&+]", re.I)
SEVERAL_SYSTEM = (
    "You fill in a function's arguments. Write a JSON array of argument objects that fit "
    "the function's schema, with values taken from the request: one object for each "
    "separate call the request asks for (most requests ask for one), and nothing else."
)
#: The array's tokens at most (four calls of a few arguments; a model that repeats itself
#: is cut there), and the calls of one function one request makes at most.
SEVERAL_TOKENS = 64
MOST_CALLS = 4
#: How the model is told of function outputs (added to the system prompt when the
#: conversation holds some), and what follows the outputs that end the turn.
RESULT_NOTE = (
    "When a function you called returns, its result comes in <tool_response> tags: answer "
    "the user's question with it."
)
RESULT_ASK = "Answer my question with this result."
#: A follow-up ("And in London?") means something only after the turns before it: the last
#: few of them (the user's words, the calls they got) are quoted before the request in the
#: questions that pick a function and write its arguments (``earlier_text``); with none,
#: every question is as for a first request.
RECENT_TURNS = 2
EARLIER_HEAD = "Earlier in the conversation:"
EARLIER_SAID = 'The user said: "{said}"'
EARLIER_CALLED = "You called {call}."


class Asker(Protocol):
    """What the reply model offers for one-off questions (llm_gguf's and llm's ReplyModel)."""

    def ask(
        self, turns: Sequence[tuple[str, str]], max_tokens: int, prefix: str = ""
    ) -> Answer: ...


class Offered(Protocol):
    """What may be called and how: a chat turn (ChatTurn) or a duplex session's offer
    (``Offer``)."""

    @property
    def tools(self) -> tuple[ToolSpec, ...]: ...

    @property
    def tool_choice(self) -> ToolChoice: ...


@dataclass(frozen=True)
class Offer:
    """A duplex session's functions and choice (EngineSession.offer_tools)."""

    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)

    def calls(self) -> bool:
        """Whether a user's turn may end in calls."""
        return bool(self.tools) and self.tool_choice.allows_calls()


@dataclass
class Plan:
    """What a turn with functions does: the calls to make, the problems of those that could
    not be made, and the tokens its questions took."""

    calls: list[ToolCall] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    def count(self, answer: Answer) -> Answer:
        self.prompt_tokens += answer.prompt_tokens
        self.output_tokens += answer.output_tokens
        return answer


@dataclass(frozen=True)
class Earlier:
    """A user's turn before the request: what they said and the calls it got."""

    said: str
    calls: tuple[ToolCall, ...] = ()


def earlier_turns(
    messages: Sequence[ChatMessage], text_of: Callable[[ChatMessage], str]
) -> tuple[Earlier, ...]:
    """The user's turns before the last message (the request) in a chat turn's messages,
    the last RECENT_TURNS of them, each with the calls the assistant made after it;
    ``text_of`` gives a message's words (the engine transcribes audio parts: only the
    turns kept are asked for)."""
    users = [i for i, m in enumerate(messages[:-1]) if m.role == "user"][-RECENT_TURNS:]
    ends = [*users[1:], len(messages) - 1] if users else []
    return tuple(
        Earlier(
            text_of(messages[start]),
            tuple(c for m in messages[start + 1 : end] for c in m.tool_calls),
        )
        for start, end in zip(users, ends, strict=True)
    )


def remembered(
    recent: Sequence[Earlier], said: str, calls: Sequence[ToolCall] = ()
) -> tuple[Earlier, ...]:
    """``recent`` with the user's turn ``said`` (and its ``calls``) added, the last
    RECENT_TURNS kept: what a duplex session holds for its next request."""
    return (*recent, Earlier(said, tuple(calls)))[-RECENT_TURNS:]


def earlier_text(recent: Sequence[Earlier]) -> str:
    """The turns before the request as the questions quote them ("" when none), a line
    each for what the user said and each call it got."""
    if not recent:
        return ""
    lines = [EARLIER_HEAD]
    for turn in recent[-RECENT_TURNS:]:
        lines.append(EARLIER_SAID.format(said=turn.said))
        lines += [EARLIER_CALLED.format(call=f"{c.name}({c.arguments})") for c in turn.calls]
    return "\n".join(lines) + "\n"


def task(spec: ToolSpec) -> str:
    """What a function does, as words that follow "you to": its description (first letter
    lowered, final period gone), else its name's words."""
    text = spec.description.strip().rstrip(".").strip()
    if not text:
        return " ".join(re.split(r"[_\-]+", spec.name)).strip()
    return text[:1].lower() + text[1:]


def choose(
    llm: Asker, turn: Offered, request: str, plan: Plan, recent: Sequence[Earlier] = ()
) -> list[ToolSpec]:
    """The functions the reply calls for ``request`` (the user's last words) under the
    turn's (or session's) tool choice; none for auto when no function gets a yes.
    ``recent``: the user's turns before it (``earlier_turns``, ``remembered``): a function
    called there that the request asks for again (``continued``) is the one called, else
    each function is asked about the request alone; none: the request is judged alone."""
    choice = turn.tool_choice
    if not turn.tools or not choice.allows_calls():
        return []
    if choice.kind == FUNCTION:
        return [s for s in turn.tools if s.name == choice.name][:1]
    wanted = continued(llm, turn.tools, request, recent, plan)
    wanted = wanted or [s for s in turn.tools if wants(llm, request, s, plan)]
    if wanted or choice.kind == AUTO:
        return wanted
    assert choice.kind == REQUIRED
    return [pick(llm, request, turn.tools, plan, earlier_text(recent))]


def wants(llm: Asker, request: str, spec: ToolSpec, plan: Plan) -> bool:
    """The model's yes or no: does ``request`` ask for what ``spec`` does?"""
    question = CHECK_QUESTION.format(request=request, task=task(spec))
    return yes(llm, question, plan)


def continued(
    llm: Asker,
    specs: Sequence[ToolSpec],
    request: str,
    recent: Sequence[Earlier],
    plan: Plan,
) -> list[ToolSpec]:
    """The offered functions called in the ``recent`` turns that ``request`` asks for once
    more (AGAIN_QUESTION, about each one's latest call and the words that got it). Asked
    first because a follow-up's words alone mislead the lone check ("And in London?" got a
    yes from order_status as well as get_weather)."""
    latest: dict[str, tuple[str, ToolCall]] = {}
    for turn in recent:
        latest.update((c.name, (turn.said, c)) for c in turn.calls)
    wanted = []
    for spec in specs:
        if spec.name not in latest:
            continue
        said, call = latest[spec.name]
        question = AGAIN_QUESTION.format(
            said=said, call=f"{call.name}({call.arguments})", request=request, task=task(spec)
        )
        if yes(llm, question, plan):
            wanted.append(spec)
    return wanted


def yes(llm: Asker, question: str, plan: Plan) -> bool:
    """The model's one-token yes or no to ``question``."""
    answer = plan.count(llm.ask([("system", CHECK_SYSTEM), ("user", question)], 1))
    return answer.text.strip().lower().startswith("yes")


def pick(
    llm: Asker, request: str, specs: Sequence[ToolSpec], plan: Plan, earlier: str = ""
) -> ToolSpec:
    """The function the model names by number (the first when its answer is no number)."""
    listed = "\n".join(f"{i}. {s.name}: {task(s)}" for i, s in enumerate(specs, start=1))
    question = PICK_QUESTION.format(earlier=earlier, request=request, functions=listed)
    answer = plan.count(llm.ask([("system", PICK_SYSTEM), ("user", question)], 3))
    number = re.search(r"\d+", answer.text)
    index = int(number.group()) - 1 if number else 0
    return specs[index] if 0 <= index < len(specs) else specs[0]


def fill_all(
    llm: Asker,
    request: str,
    chosen: Sequence[ToolSpec],
    plan: Plan,
    recent: Sequence[Earlier] = (),
) -> None:
    """The calls of the ``chosen`` functions, added to the plan: ``fill`` each, or, where
    the request joins several parts (SEVERAL_WORDS), ``fill_several`` first; a further call
    of one function (past its first) is dropped when its arguments are all those of another
    function's call ("the weather for Berlin and my order 2024" is no weather for "2024")."""
    further: list[ToolCall] = []
    for spec in chosen:
        if not (
            SEVERAL_WORDS.search(request)
            and fill_several(llm, request, spec, plan, recent, further)
        ):
            fill(llm, request, spec, plan, recent)
    for call in further:
        mine = _values(call)
        if any(c.name != call.name and mine <= _values(c) for c in plan.calls):
            plan.calls.remove(call)


def fill_several(
    llm: Asker,
    request: str,
    spec: ToolSpec,
    plan: Plan,
    recent: Sequence[Earlier],
    further: list[ToolCall],
) -> bool:
    """The calls of ``spec`` for a request that may ask for it more than once: the model
    writes a JSON array of argument objects; each that fits the schema, differs from those
    before it and takes its values from the request (past the first: a value the request
    does not hold is the model's invention) is a call, MOST_CALLS at most; those past the
    first also go to ``further``. False (nothing added) when no object fits: ``fill`` then
    asks for one, with its retry."""
    answer = plan.count(
        llm.ask(
            [("system", SEVERAL_SYSTEM), ("user", _fill_question(request, spec, recent))],
            SEVERAL_TOKENS,
            prefix="[{",
        )
    )
    said = _plain(_as_asked(request, spec))
    made: list[ToolCall] = []
    for found in _objects(answer.text):
        arguments, problems = parse_arguments(json.dumps(found), spec)
        if problems or any(c.arguments == arguments for c in made):
            continue
        call = ToolCall(f"call_{secrets.token_hex(8)}", spec.name, arguments)
        if made and not all(v in said for v in _values(call, keep_spaces=True)):
            continue
        made.append(call)
        if len(made) == MOST_CALLS:
            break
    plan.calls += made
    further += made[1:]
    return bool(made)


def _objects(text: str) -> list[object]:
    """The JSON objects of an array as the model wrote it (maybe cut off, or followed by
    other text): each whole one in order, up to the first that is not."""
    decoder, found, at = json.JSONDecoder(), [], text.find("[") + 1
    while at > 0:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] != "{":
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        found.append(value)
    return found


def _plain(text: str, keep_spaces: bool = True) -> str:
    """``text`` as values are compared: lowercase letters and digits ("80,412" is 80412,
    "Luigi's" is luigis), with single spaces between words when ``keep_spaces``."""
    words = re.sub(r"[^a-z0-9\s]", "", text.lower()).split()
    return (" " if keep_spaces else "").join(words)


def _values(call: ToolCall, keep_spaces: bool = False) -> frozenset[str]:
    """A call's argument values (the scalars of its object), each ``_plain``."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return frozenset()
    items = arguments.values() if isinstance(arguments, dict) else ()
    found = (_plain(str(v), keep_spaces) for v in items if isinstance(v, str | int | float))
    return frozenset(v for v in found if v)


def _fill_question(request: str, spec: ToolSpec, recent: Sequence[Earlier]) -> str:
    """The question that asks for ``spec``'s arguments for ``request``."""
    return FILL_QUESTION.format(
        name=spec.name,
        description=spec.description or task(spec),
        schema=json.dumps(spec.parameters or {"type": "object"}),
        earlier=earlier_text(recent),
        request=_as_asked(request, spec),
    )


def _as_asked(request: str, spec: ToolSpec) -> str:
    """The request as ``spec``'s arguments are asked for: its spoken numbers as digits where
    the function takes a number or an id (``spoken_numbers``)."""
    return spoken_numbers(request) if takes_numbers(spec) else request


def fill(
    llm: Asker, request: str, spec: ToolSpec, plan: Plan, recent: Sequence[Earlier] = ()
) -> None:
    """The call of ``spec`` with the arguments the model writes for ``request`` (after the
    ``recent`` turns, as ``choose`` takes them), added to the plan; asked once more when
    they do not fit, then the problem is the plan's. Where the function takes a number or
    an id, the request's spoken numbers are given as digits (``spoken_numbers``)."""
    turns = [("system", FILL_SYSTEM), ("user", _fill_question(request, spec, recent))]
    for attempt in range(2):
        answer = plan.count(llm.ask(turns, ARGUMENT_TOKENS, prefix="{"))
        arguments, problems = parse_arguments(answer.text, spec)
        if not problems:
            plan.calls.append(ToolCall(f"call_{secrets.token_hex(8)}", spec.name, arguments))
            return
        if attempt == 0:
            retry = FILL_RETRY.format(problems="; ".join(problems))
            turns += [("assistant", answer.text), ("user", retry)]
    plan.problems += [f"tool {spec.name}: {p}" for p in problems]


#: A parameter that holds a number or an id, by its name or its description's words.
_NUMBER_PARAMETER = re.compile(r"(^|[\W_])(id|ids|number|no|code|zip|phone)($|[\W_])", re.I)
_UNITS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen".split()
    )
}
_TENS = {
    w: 10 * i
    for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)
}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}
#: A number as recognizers write it (digits, thousands split by commas), or a number word.
_NUMBER_TOKEN = re.compile(
    r"\b(?:\d{1,3}(?:,\d{3})+|\d+|oh|" + "|".join([*_UNITS, *_TENS, *_SCALES]) + r")\b",
    re.I,
)
#: What may come between two tokens of one spoken number.
_JOINER = re.compile(r"[\s-]*|,?\s+and\s+|,\s*", re.I)


def takes_numbers(spec: ToolSpec) -> bool:
    """Whether a function takes a number or an id (a parameter typed integer or number, or
    named or described as an id, a number, a code...): its arguments want digits."""
    properties = (spec.parameters or {}).get("properties") or {}
    for name, schema in properties.items():
        schema = schema if isinstance(schema, dict) else {}
        if schema.get("type") in ("integer", "number"):
            return True
        if _NUMBER_PARAMETER.search(f"{name} {schema.get('description', '')}"):
            return True
    return False


def spoken_numbers(text: str) -> str:
    """``text`` with each spoken number as digits: "five five five oh one" -> "55501",
    "two thousand, twenty four" -> "2024", "seventy-two" -> "72", and a recognizer's
    "55,500 one" (fifty-five thousand five hundred one) -> "55501". A run of number words
    and digits is read left to right: a scale multiplies what is before it (or adds to
    what it ends), a value fits into the zeros of what is before it when it can ("twenty"
    "four"), else single digits follow one another ("five" "five"). "oh" counts only
    after a digit; a comma splits two runs unless a scale word or "and" is beside it."""
    out, at = [], 0
    for start, end, value in _number_runs(text):
        out += [text[at:start], str(value)]
        at = end
    return "".join([*out, text[at:]])


def _number_runs(text: str) -> list[tuple[int, int, int]]:
    """(start, end, value) of each spoken number in ``text`` that has a word in it or
    thousands commas (plain digits are left as they are)."""
    runs: list[tuple[int, int, int]] = []
    tokens = list(_NUMBER_TOKEN.finditer(text))
    i = 0
    while i < len(tokens):
        j = i
        while j + 1 < len(tokens) and _joins(text, tokens[j], tokens[j + 1]):
            j += 1
        words = [t.group().lower() for t in tokens[i : j + 1]]
        while words and words[0] == "oh":  # "oh" alone is a word, not a zero
            words.pop(0)
            i += 1
        if words and not (len(words) == 1 and words[0].isdigit()):
            value = _value(words)
            if value is not None:
                runs.append((tokens[i].start(), tokens[j].end(), value))
        i = j + 1
    return runs


def _joins(text: str, left: re.Match[str], right: re.Match[str]) -> bool:
    between = text[left.end() : right.start()]
    if not _JOINER.fullmatch(between):
        return False
    if "," in between or "and" in between.lower():  # "two thousand, twenty four"
        return left.group().lower() in _SCALES
    return True


def _value(words: list[str]) -> int | None:
    """The number a run of number words and digits says (``spoken_numbers``), None when
    its words do not make one."""
    total, current, last = 0, None, ""
    for word in words:
        if word == "hundred":
            current, last = (current or 1) * 100, "scale"
            continue
        if word in _SCALES:
            total, current, last = total + (current or 1) * _SCALES[word], None, "scale"
            continue
        part, kind = _part(word)
        if current is None:
            current = part
        elif last == "digit" and kind == "digit":
            current = current * 10 + part  # "five" "five", "oh" "one"
        elif (last == "tens" and kind == "digit" and part) or (last == "scale" and part < 100):
            current += part  # "twenty" "four", "hundred" "ten"
        elif last in ("tens", "teen") and kind in ("tens", "teen"):
            current = current * 100 + part  # "twenty" "twenty", "nineteen" "eighty"
        elif last == "digits" and 0 < part < 10 ** _zeros(current):
            current += part  # a recognizer's "55,500" "one"
        else:
            return None
        last = kind
    return total + (current or 0)


def _part(word: str) -> tuple[int, str]:
    """A token's value and kind: digits, digit (0-9 said), teen (10-19) or tens."""
    if word[0].isdigit():
        return int(word.replace(",", "")), "digits"
    if word == "oh":
        return 0, "digit"
    if word in _TENS:
        return _TENS[word], "tens"
    return _UNITS[word], "digit" if _UNITS[word] < 10 else "teen"


def _zeros(value: int) -> int:
    """How many zeros ``value`` ends in (0 for 0)."""
    count = 0
    while value and value % 10 == 0:
        value //= 10
        count += 1
    return count


def assistant_text(message: ChatMessage, said: str) -> str:
    """An assistant message's words (``said``) and its calls, as the model writes them."""
    return calls_text(message.tool_calls, said)


def answer_turn(outputs: Sequence[str]) -> str:
    """The user turn of the outputs that end a turn: them, then the request to answer."""
    return f"{results_text(outputs)}\n{RESULT_ASK}"


def has_results(messages: Sequence[ChatMessage]) -> bool:
    return any(m.role == "tool" for m in messages)
