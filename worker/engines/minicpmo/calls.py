"""Function calls on the minicpmo engine, through the checkpoint's own chat template: the
functions offered in its tools block, the model's "<tool_call>" replies read back as
checked calls, outputs written as the template writes them (tool_text, shared with the
reference engine).

Two paths use it: a chat turn (``tool_turn``, ``calls_from``: the model's streaming chat
path, MiniCPMOEngine.chat) and a duplex session (``CallWatch``: the model decides each
unit to listen or speak, MiniCPMOSession and the batched step). Both read calls with the
one rule here (``read_calls``).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from omnifabric.common import nesting
from omnifabric.common.tools import FUNCTION, REQUIRED, ToolChoice
from omnifabric.worker.engine import (
    ChatChunk,
    ChatMessage,
    ChatTurn,
    GenerateResult,
    ToolCall,
    ToolSpec,
)
from omnifabric.worker.engines import tool_text

log = logging.getLogger("omnifabric.worker.minicpmo")

#: Where a ChatML system turn begins and a turn ends, in the template's text.
_SYSTEM_HEAD, _TURN_END = "<|im_start|>system\n", "<|im_end|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: A duplex call whose text is not closed after this many units is read as it stands (the
#: model's turn is then ended): the model writes at most 20 tokens a unit (28 characters
#: in the unified layout), so a call of a few arguments takes 3 to 5.
MAX_CALL_UNITS = 12
#: Units a duplex session is made to listen while the outputs of its calls have not all come
#: (the reference engine's rule: no answer before the outputs it needs); past that the
#: model is free again (a slow function, or a user who moved on) and the outputs, when they
#: come, still go into the context.
MAX_AWAIT_UNITS = 10
#: Calls that could not be made (not JSON, a function not offered, arguments that do not fit
#: its schema) are answered to the model as the function's response, an error it may correct
#: by calling again, this many times in a row at most (then they are only logged).
MAX_CALL_RETRIES = 1


def tools_text(tokenizer: Any, tools: Sequence[ToolSpec], choice: ToolChoice) -> str:
    """The functions as the checkpoint's chat template writes them into the system turn
    (its tools block), and what the tool choice asks ("" when the template takes none)."""
    specs = [{"type": "function", "function": s.json()} for s in tools]
    probe = [{"role": "user", "content": "."}]
    rendered = tokenizer.apply_chat_template(probe, tools=specs, tokenize=False)
    if not rendered.startswith(_SYSTEM_HEAD) or _TURN_END not in rendered:
        return ""
    text = rendered[len(_SYSTEM_HEAD) : rendered.index(_TURN_END)].strip("\n")
    if choice.kind == REQUIRED:
        text += "\nCall at least one of these functions."
    elif choice.kind == FUNCTION:
        text += f"\nCall the function {choice.name}."
    return text


#: A template that writes no functions (the engine then offers none).
NO_TEMPLATE = "tools: this checkpoint's chat template writes no functions"


def tool_turn(tokenizer: Any, turn: ChatTurn) -> tuple[ChatTurn, tuple[str, ...]]:
    """The turn as the model's streaming path takes it (system, user and assistant
    messages): the tools block in the system message (unless the choice is none), an
    assistant's calls and a run of function outputs written as the template writes them;
    and what could not be done (a template without tools)."""
    notes: tuple[str, ...] = ()
    messages: list[ChatMessage] = []
    outputs: list[str] = []
    for message in turn.messages:
        if message.role == "tool":
            outputs.append(" ".join(p for p in message.parts if isinstance(p, str)))
            continue
        if outputs:
            messages.append(ChatMessage("user", (tool_text.results_text(outputs),)))
            outputs = []
        calls = tuple(tool_text.call_text(c) for c in message.tool_calls)
        messages.append(ChatMessage(message.role, (*message.parts, *calls)))
    if outputs:
        messages.append(ChatMessage("user", (tool_text.results_text(outputs),)))
    offered = bool(turn.tools) and turn.tool_choice.allows_calls()
    block = tools_text(tokenizer, turn.tools, turn.tool_choice) if offered else ""
    if offered and not block:
        notes = (NO_TEMPLATE,)
    elif block and messages[0].role == "system":
        messages[0] = ChatMessage("system", (*messages[0].parts, f"\n{block}"))
    elif block:
        messages.insert(0, ChatMessage("system", (block,)))
    return replace(turn, messages=tuple(messages)), notes


def calls_from(
    chunks: Iterator[ChatChunk], turn: ChatTurn, notes: tuple[str, ...]
) -> Iterator[ChatChunk]:
    """The model's reply with its calls taken out of its text: what it says before
    "<tool_call>" streams as usual, the rest is held back and read as calls when it ends
    (each checked: its function offered, its arguments fitting the schema; one that is
    not is left out and named in ``ignored``; none made: it says it could not)."""
    said, held, body = "", "", None
    try:
        for chunk in chunks:
            if chunk.done:
                yield from _ending(chunk, turn, said, body, notes, held)
                return
            if chunk.prefilled:
                yield chunk
                continue
            if body is not None:
                body += chunk.text  # a call's text (and speech) is not the reply's
                continue
            text = held + chunk.text
            at = text.find(CALL_OPEN)
            if at >= 0:
                body, text, held = text[at:], text[:at], ""
            else:
                keep = _partial_open(text)
                text, held = text[: len(text) - keep], text[len(text) - keep :]
            said += text
            if text or chunk.audio.size:
                yield replace(chunk, text=text)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` may begin "<tool_call>"."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _ending(
    done: ChatChunk,
    turn: ChatTurn,
    said: str,
    body: str | None,
    notes: tuple[str, ...],
    held: str,
) -> Iterator[ChatChunk]:
    """The calls read from ``body`` (the reply from its first "<tool_call>"), then the done
    chunk with what was left out."""
    if held:
        yield ChatChunk(text=held)
    calls, problems = read_calls(body or "", turn.tools, turn.tool_choice)
    if calls:
        yield ChatChunk(tool_calls=tuple(calls))
    elif problems and not (said + held).strip():
        yield ChatChunk(text=tool_text.CANNOT)
    elif not calls and turn.tool_choice.kind in (REQUIRED, FUNCTION) and body is None:
        problems.append(f"tool_choice {turn.tool_choice.kind}: the model called no function")
    yield replace(done, ignored=done.ignored + notes + tuple(problems))


def read_calls(
    body: str, tools: Sequence[ToolSpec], choice: ToolChoice
) -> tuple[list[ToolCall], list[str]]:
    """The calls written in ``body`` ("<tool_call>{"name": ..., "arguments": ...}
    </tool_call>" each, the last maybe unclosed), and what is wrong with those left out."""
    offered = {s.name: s for s in tools}
    if choice.kind == FUNCTION:
        offered = {choice.name: offered[choice.name]}
    calls: list[ToolCall] = []
    problems: list[str] = []
    for block in body.split(CALL_OPEN)[1:]:
        text = block.split(CALL_CLOSE)[0].strip()
        try:
            call, _ = nesting.raw_decode(text)
        except ValueError:
            problems.append(f"a call is not JSON: {text[:80]!r}")
            continue
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or name not in offered:
            shown = repr(name[:64]) if isinstance(name, str) else type(name).__name__
            problems.append(f"a call of {shown}, not a function offered")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        fitted, wrong = tool_text.parse_arguments(json.dumps(arguments), offered[name])
        if wrong:
            problems += [f"tool {name}: {p}" for p in wrong]
        else:
            calls.append(ToolCall(f"call_{secrets.token_hex(8)}", name, fitted))
    return calls, problems


def _loads(text: str) -> Any:
    try:
        return nesting.loads(text)
    except ValueError:
        return text


# ---- duplex ------------------------------------------------------------------------------


def error_text(problems: Sequence[str]) -> str:
    """What the model is told, as a function's response, of calls that could not be made."""
    return "error: the call was not made: " + "; ".join(problems)


def _closed(body: str) -> bool:
    """Every call begun in ``body`` is closed, and nothing but space follows the last."""
    return body.rstrip().endswith(CALL_CLOSE) and body.count(CALL_OPEN) == body.count(CALL_CLOSE)


class CallWatch:
    """A duplex session's function calls (MiniCPMOSession.offer_tools made it).

    Per unit the model writes up to 20 tokens; what it says before "<tool_call>" is spoken
    as usual, the tag and what follows it (the call's text, over as many units as it takes)
    is held back from the TTS (``tts_input``: the unit's TTS condition cut at the tag; a
    unit that begins inside a call runs without speech: ``silent``) and from the unit's
    text. The calls are read (``read_calls``, as a chat turn's) when the model's turn ends,
    when every call begun is closed at a unit's end, or after MAX_CALL_UNITS; the next unit
    is then made to listen (``force_next``: a turn still open is closed); the unit that
    reads them carries them (``GenerateResult.tool_calls``, its turn ended, listening unless it
    also spoke), as the reference engine's duplex calls are carried. Calls closed right at a
    unit's end with the turn still open are read one unit later (``closed``): that unit
    runs without speech and may begin another call (parallel calls split at the boundary);
    if it does not, the calls stand and what it wrote is not said. A unit made to listen
    meanwhile (a barge-in) drops a call still being written, and makes calls already closed.
    Until the outputs of the calls (``output``) all came, the session listens (at most
    MAX_AWAIT_UNITS units); once they came they go into the context before the next unit's
    ``<unit>`` as the chat path writes them (``results``). Calls that could not be made,
    with none that could, go back the same way as an error response naming what was wrong
    (``error_text``; MAX_CALL_RETRIES in a row): the model may call again or say so, where
    before it heard nothing and the caller got silence."""

    def __init__(self, tools: Sequence[ToolSpec], choice: ToolChoice, tokenizer: Any) -> None:
        self.tools = tuple(tools)
        self.choice = choice
        self.tokenizer = tokenizer
        self.body: str | None = None
        """The call's text so far (from "<tool_call>"), while the model writes one."""
        self.units = 0
        """Units the call's text took so far."""
        self.force_next = False
        """The calls were read: the next unit listens."""
        self.closed = False
        """Every call of ``body`` closed at the last unit's end, the turn still open: the
        next unit tells whether another call follows."""
        self.await_units = 0
        """Units made to listen so far while outputs are awaited."""
        self.retries = 0
        """Error responses fed in a row (reset once the model speaks without a call)."""
        self.awaiting: dict[str, str | None] = {}
        """call id -> its output (None until it comes) of the last calls made."""
        self.results: list[int] = []
        """Tokens of the outputs to feed before the next unit (all outputs came)."""
        self.session_id = ""

    @property
    def silent(self) -> bool:
        """The unit begins inside a call: it runs without speech."""
        return self.body is not None

    def take_force(self) -> bool:
        """Whether this unit must listen: once after the calls were read in an open turn,
        then while their outputs are awaited (at most MAX_AWAIT_UNITS units)."""
        force, self.force_next = self.force_next, False
        if not force and self.waiting and self.await_units < MAX_AWAIT_UNITS:
            self.await_units += 1
            force = True
        return force

    @property
    def waiting(self) -> bool:
        """Outputs of the last calls made have not all come."""
        return any(o is None for o in self.awaiting.values())

    def take_results(self) -> list[int]:
        """The outputs' tokens to feed with this unit's prefill (then none)."""
        ids, self.results = self.results, []
        return ids

    def tts_input(self, convert: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The duplex's ``_convert_results_to_tts_input`` cut at the call: the TTS speaks
        the unit's tokens before "<tool_call>" only (entries are [token id, hidden, eot])."""

        def cut(results: list[Any]) -> Any:
            return convert(self.spoken(results))

        return cut

    def spoken(self, results: list[Any]) -> list[Any]:
        """A unit's entries ([token id, hidden, eot]) that the TTS speaks: those before
        "<tool_call>" (the serial path's condition through `tts_input`, the batched step's
        in tts.py)."""
        return results[: self.speakable([int(r[0]) for r in results])]

    def speakable(self, ids: list[int]) -> int:
        """How many of a unit's tokens come before "<tool_call>" (0 inside a call)."""
        if self.body is not None:
            return 0
        for k in range(len(ids)):
            if CALL_OPEN in self.tokenizer.decode(ids[: k + 1], skip_special_tokens=True):
                return k
        return len(ids)

    def unit_result(self, result: GenerateResult, forced: bool) -> GenerateResult:
        """The unit's result with the call's text held back, and the calls once read."""
        silent = np.zeros(0, np.float32)
        if self.closed:  # the calls so far closed at the last unit's end
            self.closed = False
            more = "" if forced or result.is_listen else result.text
            if not more.lstrip().startswith(CALL_OPEN):
                if more.strip():
                    log.info("session %s: words after its calls not said", self.session_id)
                return self._made(result, "", silent)
            self.body = (self.body or "") + more
            said = ""
        elif forced and self.body is not None:
            log.info("session %s: a call cut before it ended (a forced listen)", self.session_id)
            self.body, self.units = None, 0
            return result
        elif self.body is None:
            at = -1 if result.is_listen else result.text.find(CALL_OPEN)
            if at < 0:
                self.retries = 0 if result.text.strip() else self.retries
                return result
            said, self.body = result.text[:at], result.text[at:]
        else:
            said = ""
            self.body += "" if result.is_listen else result.text
        self.units += 1
        audio = result.audio if said else silent
        turn_over = result.is_listen or result.end_of_turn
        if not (turn_over or self.units >= MAX_CALL_UNITS):
            self.closed = _closed(self.body)
            return replace(result, is_listen=False, text=said, audio=audio)
        return self._made(result, said, audio)

    def _made(self, result: GenerateResult, said: str, audio: np.ndarray) -> GenerateResult:
        """The unit's result carrying the calls of ``body``, read now; the next unit listens."""
        calls = self._read()
        # The next unit listens: it closes the turn if still open (the public code reopens
        # it when a token after <|turn_eos|> is dropped at the unit's character limit).
        self.force_next = True
        return replace(
            result,
            is_listen=not said and not audio.size,
            text=said,
            audio=audio,
            end_of_turn=True,
            tool_calls=tuple(calls),
        )

    def _read(self) -> list[ToolCall]:
        """The calls of the body, checked; what was left out is logged."""
        body, self.body, self.units = self.body or "", None, 0
        calls, problems = read_calls(body, self.tools, self.choice)
        if problems:
            log.warning("session %s: calls not made: %s", self.session_id, "; ".join(problems))
        if calls:
            self.awaiting = {c.call_id: None for c in calls}
            self.results, self.await_units = [], 0
        elif problems and self.retries < MAX_CALL_RETRIES:
            self.retries += 1
            self.awaiting = {}
            text = tool_text.results_text([error_text(problems)])
            self.results = list(self.tokenizer.encode(text, add_special_tokens=False))
        return calls

    def output(self, call_id: str, output: str) -> None:
        """A call's output; once every awaited output came, they are the next unit's
        (``results``). Others (an unknown id, a call newer calls replaced) are ignored."""
        if self.awaiting.get(call_id, "") is not None:
            log.debug("session %s: output of %r ignored (not awaited)", self.session_id, call_id)
            return
        self.awaiting[call_id] = output
        if all(o is not None for o in self.awaiting.values()):
            text = tool_text.results_text([o or "" for o in self.awaiting.values()])
            self.awaiting = {}
            self.results = list(self.tokenizer.encode(text, add_special_tokens=False))
