"""A server-VAD session's turns: the engine's own turn-taking read as the API's events.

The units the cadence sent are measured as they go (input time, which held speech); each
engine output then says what happened: speech heard (`speech_started`), the engine
answering (`speech_stopped`, `committed`, the user's item and a response of its own), a
reply spoken over (a barge-in: the reply ends `cancelled`, `turn_detected`, at once, no
more of it is sent, and the engine's turn is ended: `interrupt_response`, on unless the
client turns it off), a reply at its `max_output_tokens` (ended `incomplete` the same way)."""

from __future__ import annotations

from typing import Any

import numpy as np

from omnifabric.edge import events as ev
from omnifabric.edge import pcm
from omnifabric.edge.dialects.openai.audio import ENGINE_IN_RATE
from omnifabric.edge.dialects.openai.conversation import Conversation, Item
from omnifabric.edge.dialects.openai.responses import Response, Responses
from omnifabric.edge.dialects.openai.settings import Settings
from omnifabric.edge.dialects.openai.wire import Wire, minus

#: Units whose start is kept after the engine answered past them.
KEPT_UNITS = 8


class DuplexTurns:
    """The user's speech and the engine's replies of one duplex session."""

    def __init__(self, wire: Wire, conversation: Conversation, responses: Responses) -> None:
        self.wire = wire
        self.conversation = conversation
        self.responses = responses
        self._input_ms = 0.0
        self._unit_ms: dict[int, tuple[float, float]] = {}
        """Each unit sent: where its input begins and ends (ms; a unit cut at the end of
        speech is shorter than a second)."""
        self._speech_seqs: set[int] = set()
        self._user_speaking = False
        self._user_item = ""
        self._speech_start_ms = 0.0
        self._speech_end_ms = 0.0
        self.muted = False
        """The reply was ended (cancelled, spoken over, capped): the rest of the engine's
        turn is not sent."""
        self.end_turn = False
        """The engine's turn must end now (the driver's next unit carries force_listen)."""

    def cut(self) -> None:
        """The reply in progress ended here: mute the rest, end the engine's turn."""
        self.muted = True
        self.end_turn = True

    def appended(self, seq: int, raw: bytes) -> None:
        """A unit went to the engine as `seq` (`raw`: its float32 PCM)."""
        samples = np.frombuffer(raw, "<f4")
        start = self._input_ms
        self._input_ms += samples.size * 1000 / ENGINE_IN_RATE
        self._unit_ms[seq] = (start, self._input_ms)
        if pcm.holds_speech(samples):
            self._speech_seqs.add(seq)

    def output(self, out: ev.Output, settings: Settings, reply: Any) -> list[Any]:
        """The events of one engine output; `reply()` makes the Response of a reply the
        engine starts."""
        messages = self._heard(out)
        responses = self.responses
        current = responses.current
        if out.tool_calls:
            return messages + self._calls(out, reply)
        if out.is_listen:
            self.muted = False
            if current is not None:
                interrupted = current.heard_speech
                messages += responses.finish(
                    "cancelled" if interrupted else "completed",
                    "turn_detected" if interrupted else None,
                )
            return messages
        if current is not None and current.heard_speech and interrupts(settings):
            self.cut()
            return messages + responses.finish("cancelled", "turn_detected")
        if self.muted:
            return messages
        if current is None:
            messages += self._user_turn(out.input_transcript)
            current = responses.current = reply()
            messages += responses.begin()
        messages += responses.deltas(out.text, out.pcm)
        if _capped(current, responses.usage):
            self.cut()
            messages += responses.finish("incomplete", "max_output_tokens")
        elif out.end_of_turn:
            messages += responses.finish("completed", None)
        return messages

    def _calls(self, out: ev.Output, reply: Any) -> list[Any]:
        """The engine's turn ends in function calls: the reply (started here when the
        engine said nothing before) carries them and is done; the engine waits for their
        outputs (the client's function_call_output items)."""
        responses = self.responses
        messages: list[Any] = []
        if responses.current is None:
            messages += self._user_turn(out.input_transcript)
            responses.current = reply()
            messages += responses.begin()
        if not self.muted:
            messages += responses.deltas(out.text, out.pcm)
        for call in out.tool_calls:
            messages += responses.call(call)
        self.muted = False
        return messages + responses.finish("completed", None)

    def _heard(self, out: ev.Output) -> list[Any]:
        """speech_started when the units answered held speech (once per user turn)."""
        heard = {seq for seq in self._speech_seqs if seq <= out.seq}
        self._speech_seqs -= heard
        for seq in [s for s in self._unit_ms if s < out.seq - KEPT_UNITS]:
            del self._unit_ms[seq]
        if not heard:
            return []
        messages: list[Any] = []
        self._speech_end_ms = self._unit_ms.get(max(heard), (0.0, 0.0))[1]
        if not self._user_speaking:
            self._user_speaking = True
            self._user_item = self.wire.id("item")
            self._speech_start_ms = self._unit_ms.get(min(heard), (0.0, 0.0))[0]
            messages.append(
                self.wire.event(
                    "input_audio_buffer.speech_started",
                    audio_start_ms=int(self._speech_start_ms),
                    item_id=self._user_item,
                )
            )
        if self.responses.current is not None:
            self.responses.current.heard_speech = True
        return messages

    def _user_turn(self, transcript: str) -> list[Any]:
        """The user's turn the engine answers: speech_stopped, committed and its item."""
        if not self._user_speaking:
            return []
        self._user_speaking = False
        event = self.wire.event
        item = Item(
            self._user_item or self.wire.id("item"),
            "user",
            [{"type": "input_audio", "transcript": transcript or None}],
        )
        previous = self.conversation.append(item)
        messages = [
            event(
                "input_audio_buffer.speech_stopped",
                audio_end_ms=int(self._speech_end_ms),
                item_id=item.id,
            ),
            event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous),
            *item_added(self.wire, item, previous),
        ]
        if transcript:
            seconds = max(0.0, self._speech_end_ms - self._speech_start_ms) / 1000
            messages.append(
                event(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=item.id,
                    content_index=0,
                    transcript=transcript,
                    usage={"type": "duration", "seconds": round(seconds, 3)},
                )
            )
        return messages


def interrupts(settings: Settings) -> bool:
    """Speech over a reply ends it (turn_detection.interrupt_response, on by default)."""
    turn = settings.turn_detection or {}
    return turn.get("interrupt_response") is not False


def _capped(response: Response, usage: ev.Usage) -> bool:
    """The reply reached its max_output_tokens (text and audio tokens, as its usage)."""
    cap = response.max_tokens
    return cap is not None and minus(usage, response.usage_at_start).output_tokens >= cap


def item_added(wire: Wire, item: Item, previous: str | None) -> list[dict[str, Any]]:
    """An item joined the conversation (added and done at once)."""
    return [
        wire.event("conversation.item.added", previous_item_id=previous, item=item.json()),
        wire.event("conversation.item.done", previous_item_id=previous, item=item.json()),
    ]


def engine_reply(
    wire: Wire, settings: Settings, voice: str, session_id: str | None, usage_at_start: ev.Usage
) -> Response:
    """The Response of a reply the engine chose to make, in the session's settings."""
    return Response(
        wire.id("resp"),
        Item(wire.id("item"), "assistant", [], status="in_progress"),
        settings.speaks,
        settings.output_format,
        voice,
        settings.max_output_tokens,
        session_id,
        usage_at_start=usage_at_start,
    )
