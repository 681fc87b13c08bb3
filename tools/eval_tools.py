"""Ask a running stack requests that need a function and requests that need none, through
the OpenAI Realtime dialect, typed and spoken, and score the calls.

    omnifabric eval-tools [--url ws://HOST:PORT/v1/realtime] [--modes typed,spoken]
                          [--sets main,held-out] [--only calls|none] [--heard] [--out DIR]

Three functions are offered (get_weather, book_table, order_status). Each request is one
response on request (turn detection null) in its own connection: a typed request is an
`input_text` item, a spoken one the request rendered with Piper's voice as an
`input_audio` item (24 kHz PCM16). A request that needs a function is right when the reply
calls that function, and only it, with the expected arguments (strings compared
case-insensitively and ignoring punctuation, numbers by value); one that needs none is right
when the reply calls nothing. Printed: a line per request, then a table per set and mode
with the counts and the time to the response's end (p50/p90). Without `--url` it starts
`omnifabric serve` on free ports (the reference engine) and stops it afterwards.

Two sets: `main` (CASES: 20 requests that need a call, 20 that need none, Piper's voice at
its own rate), the figures issue 53 asks for; `held-out` (HELD_OUT: other cities,
restaurants, order numbers and phrasings, 15 and 10, spoken in turn by Piper slower,
Piper faster and espeak-ng), never looked at while the hearing was tuned, so that a change
fitted to the main set's words shows as a gap between the two; `several` (SEVERAL: 14
requests of joined parts: 8 that need a call per part, parallel calls, counted right only
when every call is made and nothing more, 4 that need one call, 2 none; Piper's voice).
`--heard` hears each spoken
request that missed with the engine's own recognizers here, as the engine hears a whole
item (hearing.hear_item), and prints what they heard.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.tools.eval_outcome import save_run

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "book_table",
        "description": "Book a table at a restaurant.",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string"},
                "people": {"type": "integer", "description": "how many people"},
                "time": {"type": "string", "description": "when, e.g. 7pm"},
            },
            "required": ["restaurant", "people", "time"],
        },
    },
    {
        "type": "function",
        "name": "order_status",
        "description": "Look up the status of a customer's order by its number.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "the order number"}},
            "required": ["order_id"],
        },
    },
]


@dataclass(frozen=True)
class Case:
    """A request and the call it needs (None: no call)."""

    text: str
    tool: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    more: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Further calls the request needs (a request of several parts), in any order."""

    def expected(self) -> list[tuple[str, dict[str, Any]]]:
        """Every call the request needs (none: []), as (function, arguments)."""
        return [(self.tool, self.arguments), *self.more] if self.tool else []


def _weather(text: str, city: str) -> Case:
    return Case(text, "get_weather", {"city": city})


def _book(text: str, restaurant: str, people: int, when: str) -> Case:
    return Case(text, "book_table", {"restaurant": restaurant, "people": people, "time": when})


def _order(text: str, order_id: str) -> Case:
    return Case(text, "order_status", {"order_id": order_id})


CASES = (
    _weather("What's the weather in Paris?", "Paris"),
    _weather("Is it raining in London right now?", "London"),
    _weather("How warm is it in Tokyo today?", "Tokyo"),
    _weather("Tell me the weather for Berlin.", "Berlin"),
    _weather("Do I need an umbrella in Seattle today?", "Seattle"),
    _weather("What's the temperature in Madrid?", "Madrid"),
    _weather("Is it sunny in Rome?", "Rome"),
    _book("Book a table for four at Luigi's at 8pm.", "Luigi's", 4, "8pm"),
    _book("Reserve a table for two at Nobu at 7pm.", "Nobu", 2, "7pm"),
    _book("Can you get me a table for six at the Ivy at 9pm?", "the Ivy", 6, "9pm"),
    _book("I'd like to book Chez Marie for three people at 6pm.", "Chez Marie", 3, "6pm"),
    _book("Book Sakura for five at 8:30pm please.", "Sakura", 5, "8:30pm"),
    _book("Please reserve a table at Roma for two at noon.", "Roma", 2, "noon"),
    _order("Where is my order 12345?", "12345"),
    _order("What's the status of order 98765?", "98765"),
    _order("Has my order 55501 shipped yet?", "55501"),
    _order("Can you check order number 4242 for me?", "4242"),
    _order("Track my order 31337.", "31337"),
    _order("Is order 77777 delivered?", "77777"),
    _order("Look up order 2024 please.", "2024"),
    Case("What is the capital of Spain?"),
    Case("How many legs does a spider have?"),
    Case("Tell me a joke about cats."),
    Case("What is two plus two?"),
    Case("Who wrote Romeo and Juliet?"),
    Case("Why is the sky blue?"),
    Case("What is the largest planet in our solar system?"),
    Case("How do I boil an egg?"),
    Case("What is the opposite of hot?"),
    Case("Say hello to my friend Anna."),
    Case("What does a bee make?"),
    Case("How many days are in a week?"),
    Case("What language do people speak in Brazil?"),
    Case("Can you recommend a good book?"),
    Case("What is ten minus three?"),
    Case("Which animal barks?"),
    Case("What's the tallest mountain in the world?"),
    Case("How do you say thank you in French?"),
    Case("What color is a banana?"),
    Case("Thanks, that's all for today."),
)

#: Held out: never looked at while the engine's hearing was worked on (module docstring).
HELD_OUT = (
    _weather("What's the weather like in Chicago?", "Chicago"),
    _weather("Will it snow in Oslo tomorrow?", "Oslo"),
    _weather("How hot is it in Cairo right now?", "Cairo"),
    _weather("Give me the forecast for Dublin.", "Dublin"),
    _weather("Is it windy in Lisbon today?", "Lisbon"),
    _book("Book a table for two at Olive Garden at 6pm.", "Olive Garden", 2, "6pm"),
    _book("Reserve a table for four at Hakata at 7pm.", "Hakata", 4, "7pm"),
    _book(
        "Can I get a table for three at the Golden Dragon at 8pm?", "the Golden Dragon", 3, "8pm"
    ),
    _book("Get me a table at Casa Lola for six people at 9pm.", "Casa Lola", 6, "9pm"),
    _book("I want to book Bistro Max for two at 1pm.", "Bistro Max", 2, "1pm"),
    _order("Where is order 80412?", "80412"),
    _order("Check the status of order 6150 please.", "6150"),
    _order("Has order 33019 arrived yet?", "33019"),
    _order("What's happening with my order 72?", "72"),
    _order("Look up my order 90210.", "90210"),
    Case("What is the boiling point of water?"),
    Case("Tell me a fun fact about octopuses."),
    Case("How many minutes are in an hour?"),
    Case("Who painted the Mona Lisa?"),
    Case("What rhymes with moon?"),
    Case("Good morning!"),
    Case("Can you help me write a short poem?"),
    Case("What's five times six?"),
    Case("Which is bigger, a cat or a horse?"),
    Case("What do cows drink?"),
)
#: Requests of joined parts: some need a call per part (parallel calls), some one call
#: however they are joined, some none (the reference engine asks these for an array of calls).
SEVERAL = (
    Case(
        "What's the weather in Paris and in London?",
        "get_weather",
        {"city": "Paris"},
        (("get_weather", {"city": "London"}),),
    ),
    Case(
        "Is it sunny in Rome and Madrid today?",
        "get_weather",
        {"city": "Rome"},
        (("get_weather", {"city": "Madrid"}),),
    ),
    Case(
        "Check orders 4242 and 31337 for me.",
        "order_status",
        {"order_id": "4242"},
        (("order_status", {"order_id": "31337"}),),
    ),
    Case(
        "What's the weather in Tokyo, Berlin and Oslo?",
        "get_weather",
        {"city": "Tokyo"},
        (("get_weather", {"city": "Berlin"}), ("get_weather", {"city": "Oslo"})),
    ),
    Case(
        "Tell me the weather in Chicago and the status of my order 80412.",
        "get_weather",
        {"city": "Chicago"},
        (("order_status", {"order_id": "80412"}),),
    ),
    Case(
        "Book a table for two at Luigi's at 7pm and check my order 12345.",
        "book_table",
        {"restaurant": "Luigi's", "people": 2, "time": "7pm"},
        (("order_status", {"order_id": "12345"}),),
    ),
    Case(
        "Is it raining in Dublin or in Lisbon?",
        "get_weather",
        {"city": "Dublin"},
        (("get_weather", {"city": "Lisbon"}),),
    ),
    Case(
        "Where are my orders 55501 and 98765?",
        "order_status",
        {"order_id": "55501"},
        (("order_status", {"order_id": "98765"}),),
    ),
    _weather("Do I need an umbrella and a coat in Seattle today?", "Seattle"),
    _book("Book a table for three at Roma at noon, inside and by the window.", "Roma", 3, "noon"),
    _order("Has my order 2024 shipped, and when will it arrive?", "2024"),
    _weather("What's the weather in Berlin, and should I bring a jacket?", "Berlin"),
    Case("What is the difference between rain and snow?"),
    Case("Tell me a joke about cats and dogs."),
)
SETS = {"main": CASES, "held-out": HELD_OUT, "several": SEVERAL}

#: A voice: (kind, voice, rate) as eval_reference.render takes them.
Voice = tuple[str, str, float]
MAIN_VOICE: Voice = ("piper", "joe", 1.0)
#: The held-out set's voices, one request each in turn: Piper slower and faster, espeak-ng.
HELD_OUT_VOICES: tuple[Voice, ...] = (
    ("piper", "joe", 1.2),
    ("piper", "joe", 0.85),
    ("espeak", "en-us", 165),
)


def voice_for(set_name: str, index: int) -> Voice:
    """The voice the ``index``-th request of a set is spoken in."""
    if set_name in ("main", "several"):
        return MAIN_VOICE
    return HELD_OUT_VOICES[index % len(HELD_OUT_VOICES)]


@dataclass
class Outcome:
    mode: str
    text: str
    expected: str | None
    calls: list[dict[str, Any]]
    right: bool
    seconds: float
    reply: str = ""
    error: str = ""
    set: str = "main"
    voice: str = ""
    heard: str = ""
    """What the engine's recognizers hear in a spoken miss (``--heard``), else ""."""


def _norm(value: Any) -> Any:
    """A value as compared: strings without case, a leading "the", spaces and punctuation;
    numbers given as digits in a string by value."""
    if isinstance(value, str):
        text = re.sub(r"^the\s+", "", value.strip().lower())
        text = re.sub(r"[^a-z0-9:]", "", text)
        return int(text) if text.isdigit() and len(text) < 4 else text
    return value


def scored(case: Case, calls: list[dict[str, Any]]) -> bool:
    """The reply's calls against the case: exactly the calls it needs (each function with
    the expected arguments, in any order), or no call at all."""
    want = case.expected()
    if len(calls) != len(want):
        return False
    left = []
    for call in calls:
        try:
            got = json.loads(call["arguments"])
        except ValueError:
            return False
        left.append((call["name"], got))
    for name, arguments in want:
        hit = next((g for g in left if g[0] == name and _fits(g[1], arguments)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True


def _fits(got: Any, arguments: dict[str, Any]) -> bool:
    return isinstance(got, dict) and all(
        _norm(got.get(k)) == _norm(v) for k, v in arguments.items()
    )


def spoken_item(text: str, voice: Voice = MAIN_VOICE) -> dict[str, Any]:
    """`text` in ``voice`` (Piper's by default) as an input_audio item (24 kHz PCM16)."""
    from scipy.signal import resample_poly

    from omnifabric.tools.eval_reference import render

    audio = render(*voice, text)
    pcm24 = resample_poly(audio, 3, 2)
    pcm16 = (np.clip(pcm24, -1, 1) * 32767).astype("<i2").tobytes()
    part = {"type": "input_audio", "audio": base64.b64encode(pcm16).decode()}
    return {"type": "message", "role": "user", "content": [part]}


def typed_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def ask(
    url: str, case: Case, mode: str, timeout_s: float, item: dict[str, Any] | None = None
) -> Outcome:
    """One request in its own connection (``item``: the request as sent, by default typed
    or in the main voice as ``mode`` says); its calls scored."""
    from websockets.asyncio.client import connect

    if item is None:
        item = spoken_item(case.text) if mode == "spoken" else typed_item(case.text)
    session = {
        "type": "realtime",
        "tools": TOOLS,
        "output_modalities": ["text"],
        "audio": {"input": {"turn_detection": None}},
    }
    outcome = Outcome(mode, case.text, case.tool, [], False, 0.0)
    async with connect(f"{url}?model=eval", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        started = time.monotonic()
        await ws.send(json.dumps({"type": "response.create"}))
        async with asyncio.timeout(timeout_s):
            async for raw in ws:
                event = json.loads(raw)
                kind = event["type"]
                if kind == "response.function_call_arguments.done":
                    outcome.calls.append({"name": event["name"], "arguments": event["arguments"]})
                elif kind == "response.output_text.delta":
                    outcome.reply += event["delta"]
                elif kind == "error":
                    outcome.error = event["error"]["message"]
                    break
                elif kind == "response.done":
                    break
    outcome.seconds = time.monotonic() - started
    outcome.right = not outcome.error and scored(case, outcome.calls)
    return outcome


def table(outcomes: list[Outcome]) -> str:
    """A row per set and mode (the main set first): the counts and the times."""
    from omnifabric.common.stats import percentile

    rows = [
        "| set | mode | needs a call: right | needs none: right | errors "
        "| response end p50 / p90 s |",
        "|---|---|---|---|---|---|",
    ]
    groups = sorted({(o.set, o.mode) for o in outcomes}, key=lambda g: (g[0] != "main", g))
    for set_name, mode in groups:
        group = [o for o in outcomes if (o.set, o.mode) == (set_name, mode)]
        need = [o for o in group if o.expected]
        none = [o for o in group if not o.expected]
        seconds = [o.seconds for o in group]
        rows.append(
            f"| {set_name} | {mode} | {sum(o.right for o in need)}/{len(need)} "
            f"| {sum(o.right for o in none)}/{len(none)} | {sum(bool(o.error) for o in group)} "
            f"| {percentile(seconds, 50):.2f} / {percentile(seconds, 90):.2f} |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class Request:
    """One request of a run: its case, set, mode and the voice it is spoken in ("" typed)."""

    case: Case
    set: str
    mode: str
    voice: Voice | None = None

    def item(self) -> dict[str, Any]:
        if self.voice is None:
            return typed_item(self.case.text)
        return spoken_item(self.case.text, self.voice)


def plan(sets: list[str], modes: list[str], only: str = "all") -> list[Request]:
    """The run's requests: each set's cases (``only``: those that need a call, ``calls``,
    or none, ``none``) in each mode, set by set."""
    requests = []
    for set_name in sets:
        for mode in modes:
            for i, case in enumerate(SETS[set_name]):
                if only == "calls" and case.tool is None or only == "none" and case.tool:
                    continue
                voice = voice_for(set_name, i) if mode == "spoken" else None
                requests.append(Request(case, set_name, mode, voice))
    return requests


def voice_name(voice: Voice | None) -> str:
    return "" if voice is None else f"{voice[0]}:{voice[1]}@{voice[2]:g}"


async def run_all(
    url: str, requests: list[Request], timeout_s: float, hear: Hearer | None = None
) -> list[Outcome]:
    """Each request in turn; with ``hear``, what a spoken miss was heard as."""
    outcomes = []
    for request in requests:
        case, mode = request.case, request.mode
        item = request.item()
        try:
            outcome = await ask(url, case, mode, timeout_s, item)
        except (TimeoutError, OSError) as exc:
            outcome = Outcome(mode, case.text, case.tool, [], False, timeout_s, error=str(exc))
        outcome.set, outcome.voice = request.set, voice_name(request.voice)
        if hear is not None and request.voice is not None and not outcome.right:
            outcome.heard = hear(item)
        outcomes.append(outcome)
        print(line(outcome), flush=True)
    return outcomes


def line(outcome: Outcome) -> str:
    """A request's printed line: right or missed, its calls, time, and what was heard."""
    mark = "ok " if outcome.right else "MISS"
    calls = ", ".join(f"{c['name']}{c['arguments']}" for c in outcome.calls) or "-"
    where = outcome.mode if outcome.set == "main" else f"{outcome.set} {outcome.mode}"
    voice = f" {outcome.voice}" if outcome.voice and outcome.set != "main" else ""
    heard = f" heard {outcome.heard!r}" if outcome.heard else ""
    return f"{mark} [{where}{voice}] {outcome.text!r} -> {calls} ({outcome.seconds:.2f} s){heard}"


#: What a spoken request's item was heard as (``engine_hearing``).
Hearer = Callable[[dict[str, Any]], str]


def engine_hearing() -> Hearer:
    """The reference engine's recognizers, loaded here, hearing an input_audio item as the
    engine hears one offered these functions (the edge's resampling, hearing.hear_item
    with the names the functions hold, at the closer decoding)."""
    import torch

    from omnifabric.edge.dialects.openai.audio import heard
    from omnifabric.worker.engine import ToolSpec
    from omnifabric.worker.engines.reference import moonshine
    from omnifabric.worker.engines.reference.asr import Transcriber
    from omnifabric.worker.engines.reference.engine import hearing_context
    from omnifabric.worker.engines.reference.hearing import Ears, hear_item

    torch.set_num_threads(1)
    ears = Ears(Transcriber(), moonshine.Moonshine())
    specs = [ToolSpec(t["name"], t["description"], t["parameters"]) for t in TOOLS]
    context = hearing_context("", specs)

    def hear(item: dict[str, Any]) -> str:
        audio = heard(base64.b64decode(item["content"][0]["audio"]), "audio/pcm")
        return hear_item(ears, audio, context, True)[0]

    return hear


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omnifabric eval-tools", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--url", help="a running edge's /v1/realtime (default: start one here)")
    parser.add_argument("--modes", default="typed,spoken", help="typed, spoken")
    parser.add_argument(
        "--sets",
        default="main",
        help="main (issue 53's 20 + 20), held-out (15 + 10), several (12 + 2: parallel calls)",
    )
    parser.add_argument(
        "--only", choices=("all", "calls", "none"), default="all",
        help="the requests that need a call, or those that need none",
    )  # fmt: skip
    parser.add_argument(
        "--heard", action="store_true",
        help="hear each spoken miss with the engine's recognizers here, and print it",
    )  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per request")
    parser.add_argument("--out", type=Path, help="folder for results.json and table.md")
    parser.add_argument("serve_args", nargs="*", help="extra `omnifabric serve` flags (after --)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("typed", "spoken"):
            parser.error(f"unknown mode {mode!r}: typed or spoken")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    for set_name in sets:
        if set_name not in SETS:
            parser.error(f"unknown set {set_name!r}: {', '.join(SETS)}")
    requests = plan(sets, modes, args.only)
    hear = engine_hearing() if args.heard and "spoken" in modes else None
    proc = None
    url = args.url
    if url is None:
        from omnifabric.tools.eval_reference import start_stack

        proc, url = start_stack(args.serve_args)
    try:
        outcomes = asyncio.run(run_all(url, requests, args.timeout_s, hear))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    report = table(outcomes)
    print(report)
    if args.out:
        save_run(args.out, outcomes, report)
    return 0
