"""A server-VAD session's turns: the engine's own turn-taking read as the API's events.

The units the cadence sent are measured as they go (input time, which held speech); each
engine output then says what happened: speech heard (`speech_started`), the engine
answering (`speech_stopped`, `committed`, the user's item and a response of its own), a
reply spoken over and ended (`cancelled`, `turn_detected`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from omnifabric.edge import events as ev
from omnifabric.edge.dialects.half_duplex import SPEECH_RMS
from omnifabric.edge.dialects.openai.audio import ENGINE_IN_RATE
from omnifabric.edge.dialects.openai.conversation import Conversation, Item
from omnifabric.edge.dialects.openai.responses import Response, Responses
from omnifabric.edge.dialects.openai.settings import Settings
from omnifabric.edge.dialects.openai.wire import Wire

#: Units whose start is kept after the engine answered past them.
KEPT_UNITS = 8


class DuplexTurns:
    """The user's speech and the engine's replies of one duplex session."""

    def __init__(self, wire: Wire, conversation: Conversation, responses: Responses) -> None:
        self.wire = wire
        self.conversation = conversation
        self.responses = responses
        self._input_ms = 0.0
        self._unit_start_ms: dict[int, float] = {}
        self._speech_seqs: set[int] = set()
        self._user_speaking = False
        self._user_item = ""
        self._speech_start_ms = 0.0
        self._speech_end_ms = 0.0
        self.muted = False
        """The client cancelled the reply: its remaining output is not sent."""

    def appended(self, seq: int, pcm: bytes) -> None:
        """A unit went to the engine as `seq`."""
        self._unit_start_ms[seq] = self._input_ms
        samples = np.frombuffer(pcm, "<f4")
        self._input_ms += samples.size * 1000 / ENGINE_IN_RATE
        if samples.size and float(np.sqrt(np.mean(samples**2))) > SPEECH_RMS:
            self._speech_seqs.add(seq)

    def output(self, out: ev.Output, reply: Any) -> list[Any]:
        """The events of one engine output; `reply()` makes the Response of a reply the
        engine starts."""
        messages = self._heard(out)
        responses = self.responses
        if out.is_listen:
            self.muted = False
            current = responses.current
            if current is not None:
                interrupted = current.heard_speech
                messages += responses.finish(
                    "cancelled" if interrupted else "completed",
                    "turn_detected" if interrupted else None,
                )
            return messages
        if self.muted:
            return messages
        if responses.current is None:
            messages += self._user_turn(out.input_transcript)
            responses.current = reply()
            messages += responses.begin()
        messages += responses.deltas(out.text, out.pcm)
        if out.end_of_turn:
            messages += responses.finish("completed", None)
        return messages

    def _heard(self, out: ev.Output) -> list[Any]:
        """speech_started when the units answered held speech (once per user turn)."""
        heard = {seq for seq in self._speech_seqs if seq <= out.seq}
        self._speech_seqs -= heard
        for seq in [s for s in self._unit_start_ms if s < out.seq - KEPT_UNITS]:
            del self._unit_start_ms[seq]
        if not heard:
            return []
        messages: list[Any] = []
        self._speech_end_ms = self._unit_start_ms.get(max(heard), 0.0) + 1000.0
        if not self._user_speaking:
            self._user_speaking = True
            self._user_item = self.wire.id("item")
            self._speech_start_ms = self._unit_start_ms.get(min(heard), 0.0)
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
            messages.append(
                event(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=item.id,
                    content_index=0,
                    transcript=transcript,
                )
            )
        return messages


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
