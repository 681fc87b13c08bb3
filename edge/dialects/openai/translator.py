"""The OpenAI Realtime dialect's translator: client events -> commands, session and turn
events -> server events. The parts it joins: wire (ids, errors, notices), settings
(session.update), conversation (items, chat input), responses (a response's events),
duplex (the engine's turn-taking as VAD events) and audio (formats). The driver's cadence
(edge.cadence, PACED) cuts, paces and pads the audio of a server-VAD session."""

from __future__ import annotations

from typing import Any

from omnifabric.common.tools import ToolChoice
from omnifabric.edge import events as ev
from omnifabric.edge import fields
from omnifabric.edge.cadence import PACED
from omnifabric.edge.chat import (
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnStarted,
    TurnToolCall,
)
from omnifabric.edge.dialects.base import DuplexDialect, Traits
from omnifabric.edge.dialects.openai import audio
from omnifabric.edge.dialects.openai.conversation import (
    FUNCTION_OUTPUT,
    Conversation,
    Item,
    ItemParser,
    TurnRequest,
    chat_input,
)
from omnifabric.edge.dialects.openai.duplex import DuplexTurns, engine_reply, item_added
from omnifabric.edge.dialects.openai.responses import Response, Responses
from omnifabric.edge.dialects.openai.settings import (
    Settings,
    SettingsUpdate,
    Voices,
    init_command,
    max_tokens,
    metadata,
    modalities,
    parse_tool_choice,
    parse_tools,
    session_json,
)
from omnifabric.edge.dialects.openai.wire import BadParam, Wire
from omnifabric.edge.errors import EdgeError, InvalidEvent, UnknownEvent

#: What the client is told for each way a session ends that is not its own doing:
#: close reason -> (error code, error type).
CLOSE_ERRORS = {
    ev.TIMEOUT: ("session_expired", "invalid_request_error"),
    ev.CONTEXT_FULL: ("context_length_exceeded", "invalid_request_error"),
    ev.SERVER_SHUTDOWN: ("server_shutdown", "server_error"),
}


class OpenAIRealtime(DuplexDialect):
    """/v1/realtime?model=... (no mode=)."""

    name = "openai_realtime"
    traits = Traits(recorded=True, lease_on_init=True, cadence=PACED, early_results=True)
    mode = "audio"

    def __init__(self, model: str = "") -> None:
        self.model = model
        self.settings = Settings()
        self.wire = Wire()
        self.conversation = Conversation()
        self.responses = Responses(self.wire, self.conversation)
        self.duplex = DuplexTurns(self.wire, self.conversation, self.responses)
        self._parser = ItemParser(self.wire.id)
        self._buffer = audio.InputBuffer()
        self._init_sent = False
        self._outputs_sent = False
        """A function's output went to the duplex engine since the last response.create."""

    @property
    def items(self) -> list[Item]:
        return self.conversation.items

    @property
    def _voices(self) -> Voices:
        return Voices(self.voices)

    def error(self, err: EdgeError) -> dict[str, Any]:
        return self.wire.error(err)

    def not_ready(self, cmd: ev.Command) -> str:
        return "the session has no worker yet"

    def _send(self, *messages: Any) -> list[ev.Command]:
        return [ev.SendCommand(tuple(messages))]

    # ---- session ----------------------------------------------------------------------

    def session_json(self) -> dict[str, Any]:
        s = self.settings
        return session_json(s, self.session_id, self.model, self._voices.name(s.voice))

    def opening(self) -> list[Any]:
        return [self.wire.event("session.created", session=self.session_json())]

    def _session_update(self, event: dict[str, Any]) -> list[ev.Command]:
        update = SettingsUpdate(self.wire, self._voices, self.settings)
        self.settings = update.apply(event.get("session"), started=self._init_sent)
        return self._send(self.wire.event("session.updated", session=self.session_json()))

    # ---- client events ------------------------------------------------------------------

    def decode(self, message: Any) -> list[ev.Command]:
        self.wire.client_event_id = None
        if isinstance(message, bytes):
            raise InvalidEvent("binary frames are not part of the protocol: send JSON events")
        try:
            event = fields.parse_frame(message)
        except fields.InvalidJson as exc:
            raise InvalidEvent(f"the event is not valid JSON ({exc})") from None
        event_id = event.get("event_id")
        self.wire.client_event_id = event_id if isinstance(event_id, str) else None
        kind = event["type"]
        handler = self._HANDLERS.get(kind)
        if handler is None:
            raise UnknownEvent(f"unknown event type {kind[:64]!r}")
        return handler(self, event)

    def _duplex(self) -> bool:
        """The conversation is (or becomes with the next audio) a duplex session."""
        return self._init_sent or self.settings.turn_detection is not None

    def _append(self, event: dict[str, Any]) -> list[ev.Command]:
        kind = self.settings.input_format
        samples = audio.decode_audio(audio.b64(event.get("audio"), "audio"), kind)
        rate = audio.rate(kind)
        if not self._duplex():
            self._buffer.append(samples, rate)
            return []
        commands: list[ev.Command] = []
        if not self._init_sent:
            self._init_sent = True
            ref_audio = self._voices.audio(self.settings.voice)
            commands.append(init_command(self.settings, ref_audio))
        # What the buffer held before turn detection was on goes first.
        commands += [ev.AudioCommand(held, at) for held, at in self._buffer.take()]
        return [*commands, ev.AudioCommand(samples, rate)]

    def _commit(self, event: dict[str, Any]) -> list[ev.Command]:
        if self._duplex():
            raise InvalidEvent(
                "with turn detection on, the engine takes turns itself: set "
                "audio.input.turn_detection to null for manual commits"
            )
        if not self._buffer:
            raise InvalidEvent("input_audio_buffer_commit_empty: the input audio buffer is empty")
        heard = self._buffer.take_heard()
        part = {"type": "input_audio", "transcript": None}
        item = Item(self.wire.id("item"), "user", [part], heard.astype("<f4").tobytes())
        previous = self.conversation.append(item)
        committed = self.wire.event(
            "input_audio_buffer.committed", item_id=item.id, previous_item_id=previous
        )
        return self._send(committed, *item_added(self.wire, item, previous))

    def _clear(self, event: dict[str, Any]) -> list[ev.Command]:
        if self._init_sent:
            raise InvalidEvent("the duplex session hears the audio as it comes: nothing to clear")
        self._buffer.take()
        return self._send(self.wire.event("input_audio_buffer.cleared"))

    def _item_create(self, event: dict[str, Any]) -> list[ev.Command]:
        body = event.get("item")
        if not isinstance(body, dict):
            raise BadParam("item", "'item' must be an object")
        item = self._parse_item(body, "item", self.settings.tools)
        before = self.conversation.insert(item, event.get("previous_item_id"))
        added = self._send(*item_added(self.wire, item, before))
        if not self._init_sent:
            return added
        if item.type == FUNCTION_OUTPUT and item.call is not None:
            # The duplex engine goes on from the output before its next unit; the
            # client's response.create that usually follows is taken as said.
            self._outputs_sent = True
            return [*added, ev.ToolOutputCommand(item.call.call_id, item.output)]
        self.wire.ignored(
            "conversation.item.create",
            "the duplex engine hears the session's audio only: items are kept for the "
            "conversation's record",
        )
        return added

    def _item_delete(self, event: dict[str, Any]) -> list[ev.Command]:
        item = self.conversation.delete(event.get("item_id"))
        return self._send(self.wire.event("conversation.item.deleted", item_id=item.id))

    def _item_retrieve(self, event: dict[str, Any]) -> list[ev.Command]:
        item = self.conversation.get(event.get("item_id"))
        return self._send(self.wire.event("conversation.item.retrieved", item=item.json()))

    def _item_truncate(self, event: dict[str, Any]) -> list[ev.Command]:
        item = self.conversation.get(event.get("item_id"))
        end_ms = event.get("audio_end_ms")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise BadParam("audio_end_ms", "audio_end_ms must be an integer >= 0")
        if item.role != "assistant":
            raise BadParam("item_id", "only an assistant item's audio can be truncated")
        part = event.get("content_index", 0)
        last = max(0, len(item.parts) - 1)
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part <= last:
            raise BadParam("content_index", f"content_index must be an integer in [0, {last}]")
        item.truncate(end_ms)
        truncated = self.wire.event(
            "conversation.item.truncated", item_id=item.id, content_index=part, audio_end_ms=end_ms
        )
        return self._send(truncated)

    def _response_create(self, event: dict[str, Any]) -> list[ev.Command]:
        if self.responses.current is not None:
            raise InvalidEvent(
                "conversation_already_has_active_response: wait for response.done or cancel it"
            )
        if self._init_sent and self._outputs_sent:
            self._outputs_sent = False  # the engine answers the outputs by itself
            return []
        if self._init_sent:
            raise InvalidEvent(
                "the duplex engine answers by itself in this session: responses on request "
                "need audio.input.turn_detection null, set before the first audio"
            )
        body = event.get("response") or {}
        if not isinstance(body, dict):
            raise BadParam("response", "'response' must be an object")
        response, request = self._requested(body)
        chat = chat_input(request)
        self.responses.current = response
        return [ev.TurnCommand(chat=chat)]

    def _requested(self, body: dict[str, Any]) -> tuple[Response, TurnRequest]:
        """A response.create's settings (each field null or absent: the session's)."""
        s = self.settings
        speaks = s.speaks
        if body.get("output_modalities") is not None:
            speaks = modalities(body["output_modalities"], "response") == ("audio",)
        instructions = body.get("instructions")  # LiveKit sends `instructions: null`
        if instructions is None:
            instructions = s.instructions
        if not isinstance(instructions, str):
            raise BadParam("response.instructions", "instructions must be a string")
        cap = s.max_output_tokens
        if body.get("max_output_tokens") is not None:
            cap = max_tokens(body["max_output_tokens"], "response")
        output = fields.obj(fields.obj(body, "audio"), "output")
        output_format = s.output_format
        if output.get("format") is not None:
            output_format = audio.parse_format(output["format"], "response.audio.output.format")
        voice = s.voice if output.get("voice") is None else output["voice"]
        if not isinstance(voice, str):
            raise BadParam("response.audio.output.voice", "voice must be a string")
        tags = metadata(body.get("metadata"), "response.metadata")
        specs = s.tools
        if body.get("tools") is not None:
            specs = parse_tools(body["tools"], "response.tools")
        choice = s.tool_choice if body.get("tools") is None else ToolChoice()
        if body.get("tool_choice") is not None:
            choice = parse_tool_choice(body["tool_choice"], specs, "response.tool_choice")
        items = self._response_items(body, specs)
        item = Item(self.wire.id("item"), "assistant", [], status="in_progress")
        response = Response(
            self.wire.id("resp"),
            item,
            speaks,
            output_format,
            self._voices.name(voice),
            cap,
            self.session_id,
            metadata=tags,
        )
        ref_audio = self._voices.audio(voice)
        return response, TurnRequest(instructions, items, speaks, ref_audio, cap, specs, choice)

    def _parse_item(self, body: dict[str, Any], where: str, tools: Any) -> Item:
        fmt = self.settings.input_format
        return self._parser.parse(body, where, fmt, self.conversation, tools)

    def _response_items(self, body: dict[str, Any], tools: Any) -> list[Item]:
        if body.get("input") is None:
            return [] if body.get("conversation") == "none" else list(self.items)
        if not isinstance(body["input"], list):
            raise BadParam("response.input", "response.input must be a list of items")
        items = []
        for i, entry in enumerate(body["input"]):
            if isinstance(entry, dict) and entry.get("type") == "item_reference":
                items.append(self.conversation.get(entry.get("id"), f"response.input[{i}].id"))
            elif isinstance(entry, dict):
                where = f"response.input[{i}]"
                items.append(self._parse_item(entry, where, tools))
            else:
                raise BadParam(f"response.input[{i}]", "an input entry must be an object")
        return items

    def _response_cancel(self, event: dict[str, Any]) -> list[ev.Command]:
        if self.responses.current is None:
            raise InvalidEvent("response_cancel_not_active: no response is in progress")
        done = self.responses.finish("cancelled", "client_cancelled")
        if self._init_sent:  # a duplex reply: the next unit ends the engine's turn
            self.duplex.muted = True
            return [*self._send(*done), ev.EndTurnCommand()]
        return [ev.CancelTurnCommand(), *self._send(*done)]

    def _output_clear(self, event: dict[str, Any]) -> list[ev.Command]:
        current = self.responses.current
        commands = self._response_cancel(event) if current is not None else []
        cleared = self.wire.event(
            "output_audio_buffer.cleared", response_id=current.id if current else None
        )
        return [*commands, *self._send(cleared)]

    _HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "conversation.item.delete": _item_delete,
        "conversation.item.retrieve": _item_retrieve,
        "conversation.item.truncate": _item_truncate,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
        "output_audio_buffer.clear": _output_clear,
    }

    # ---- session events -> client ---------------------------------------------------------

    def appended(self, seq: int, cmd: ev.AppendCommand) -> None:
        self.duplex.appended(seq, cmd.pcm)

    def after_output(self, event: ev.Output) -> list[ev.Command]:
        """A reply ended by a barge-in or its token cap: the engine's turn ends too."""
        end, self.duplex.end_turn = self.duplex.end_turn, False
        return [ev.EndTurnCommand()] if end else []

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        if isinstance(event, ev.Created):
            for note in event.notes:  # what the leased engine cannot use
                self.wire.ignored(note.split(":", 1)[0] or note, note)
            return []
        if isinstance(event, ev.Output):
            self.responses.usage = event.usage
            return self.duplex.output(event, self.settings, self._engine_reply)
        if isinstance(event, ev.Closed):
            return self._session_closed(event)
        # Queue events, pauses and the time limit's warning: nothing in this protocol (the
        # limit's end is an error, session_expired).
        return []

    def _engine_reply(self) -> Response:
        voice = self._voices.name(self.settings.voice)
        usage_at_start = self.responses.usage_at_end
        return engine_reply(self.wire, self.settings, voice, self.session_id, usage_at_start)

    def encode_turn(self, event: TurnEvent) -> list[Any]:
        if isinstance(event, TurnStarted):
            return self.responses.begin()
        if isinstance(event, TurnDelta):
            return self.responses.deltas(event.text, event.pcm)
        if isinstance(event, TurnToolCall):
            return self.responses.call(event.call)
        if isinstance(event, TurnDone):
            result = event.result
            if self.responses.current is None:
                return []
            if result.reason == "max_tokens":
                return self.responses.finish("incomplete", "max_output_tokens", result.usage)
            return self.responses.finish("completed", None, result.usage)
        return []  # queued, leased, prefilled: nothing in this protocol

    def turn_failed(self, err: EdgeError) -> list[Any]:
        failure = self.error(err)
        if self.responses.current is None:
            return [failure]
        detail = {"type": failure["error"]["type"], "code": err.code, "message": err.message}
        return [failure, *self.responses.finish("failed", None, ev.Usage(), detail)]

    def _session_closed(self, event: ev.Closed) -> list[Any]:
        messages = self.responses.finish("incomplete", None)
        if event.reason in (ev.USER_STOP, ev.CLIENT_CLOSED):
            return messages
        code, kind = CLOSE_ERRORS.get(
            event.reason, (event.error_code or "server_error", "server_error")
        )
        message = event.message or event.reason
        error = {"type": kind, "code": code, "message": message, "param": None, "event_id": None}
        messages.append(self.wire.event("error", error=error))
        return messages


__all__ = ["OpenAIRealtime"]
