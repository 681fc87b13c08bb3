"""What a dialect is: a translator between one client protocol and the edge's domain.

A dialect turns each client message into commands (edge.events) and each session event
into the client's messages. It holds only its own protocol state (turn numbers, what the
client asked to end with), never a socket, a task or a fabric call, so it is tested with
plain function calls. The connection drivers (edge.connection) own the loop; the
transports (edge.transports) own the bytes.

Two kinds: a duplex dialect drives one SessionCore for the connection's life; a chat
dialect drives one turn per request (edge.chat).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnifabric.edge import events as ev
from omnifabric.edge.chat import TurnEvent
from omnifabric.edge.errors import ALREADY_INITIALIZED, EdgeError


@dataclass(frozen=True)
class Refusal:
    """A transport-level end instead of a message: gRPC ends the call with `status` (a
    grpc.StatusCode name) and `details`."""

    status: str
    details: str


@dataclass(frozen=True)
class Traits:
    """What a duplex dialect is, as the connection driver reads it: fixed for the dialect."""

    recorded: bool = False
    """Its sessions go to the opt-in recorder (edge.recording)."""
    resumable: bool = False
    """Its sessions can be resumed after a dropped connection (a token in their start,
    `seq` on their events)."""
    holds_input_until_started: bool = False
    """Read no client message after the init until the session started (gRPC clients
    pipeline their units right behind the init)."""
    already_initialized: str = ALREADY_INITIALIZED
    """The text of a second init (SessionCore.take_init refuses it)."""
    app_mode: str | None = None
    """The app its sessions belong to (edge.apps: switched on and off apart); None: the
    session's mode's."""
    lease_on_init: bool = False
    """Wait in the queue only once the client's first init arrives, not from the connect
    (a dialect whose client settles its session first, or may never need a duplex slot)."""
    cadence: str | None = None
    """How its client's audio becomes units (edge.cadence: CUT, PACED), or None: the client
    sends whole units (AppendCommand)."""
    early_results: bool = False
    """Its clients take the model's output between units: a reply the worker begins after
    a unit's result goes out as soon as its first piece is made, not with the next unit's
    result (SessionStart.early_results). Off where a client is promised one result per
    unit (the legacy page), or the worker feeds the units itself (half-duplex); a gRPC
    client asks per session (InitCommand.early_results)."""


@dataclass(frozen=True)
class SessionFacts:
    """What the driver tells a dialect once, before its first message: the session's id
    and the registered voices (edge.voices: a voice id -> its reference audio, float32
    16 kHz PCM, None when unknown)."""

    session_id: str
    voices: Callable[[str], bytes | None] | None = None


class DuplexDialect:
    """Base of duplex translators; subclasses override decode, encode and error."""

    name = "duplex"
    traits = Traits()
    #: audio or video; None until the first message names it (gRPC).
    mode: str | None = None
    #: The client's own session id (legacy path), or None for a new one; the session's
    #: id once bound.
    session_id: str | None = None
    #: Set when the client asks to resume a session instead of starting one: its token and
    #: the last event seq it received.
    resume_token = ""
    last_seq = 0
    #: The registered voices, from the facts.
    voices: Callable[[str], bytes | None] | None = None

    def bind(self, facts: SessionFacts) -> None:
        """The session's facts (the driver calls this once, before opening())."""
        self.session_id = facts.session_id
        self.voices = facts.voices

    def refusal(self) -> EdgeError | None:
        """An error that refuses the connection before any session (bad mode or id)."""
        return None

    def opening(self) -> list[Any]:
        """Messages sent as soon as the connection is served (before any queueing)."""
        return []

    def encode_turn(self, event: TurnEvent) -> list[Any]:
        """A chat turn's event (ev.TurnCommand) -> the client's messages."""
        return []

    def turn_failed(self, err: EdgeError) -> list[Any]:
        """The client's messages for a chat turn (ev.TurnCommand) that failed with err."""
        return [self.error(err)]

    def decode(self, message: Any) -> list[ev.Command]:
        """One client message -> commands. Raises EdgeError (or fields.InvalidJson)."""
        raise NotImplementedError

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        """One session event -> the client's messages, in send order."""
        raise NotImplementedError

    def error(self, err: EdgeError) -> Any:
        """The client's error message (or a Refusal) for err."""
        raise NotImplementedError

    def not_ready(self, cmd: ev.Command) -> str:
        """The text for input that arrives before the session started (SessionCore's
        require_started refuses it)."""
        return "send the session's init first"

    def init_refused(self, err: EdgeError) -> EdgeError:
        """The error for an init the leased worker cannot take (outside its limits); by
        default the session stays open for a corrected init."""
        return err

    def appended(self, seq: int, cmd: ev.AppendCommand) -> None:
        """A unit went to the worker as `seq` (dialects that report input time use it)."""

    def stop_turn(self) -> list[ev.Command]:
        """Commands that end the model's turn now (an operator's or a page's stop button);
        none where the dialect has no such stop."""
        return []

    def after_output(self, event: ev.Output) -> list[ev.Command]:
        """Commands the driver runs once `event` went out (half-duplex drops the audio held
        when an answer starts); none by default."""
        return []

    def client_state(self) -> bytes:
        """What the dialect needs back to rebuild itself on a resume (kept by the worker)."""
        return b""

    def replay(self, event: ev.Reattached) -> list[Any]:
        """A resumed session's first messages: the answer to the resume and the events the
        client missed (after `last_seq`). Raises EdgeError (ResumeExpired) when those are
        no longer kept."""
        raise NotImplementedError


class ChatDialect:
    """Base of chat translators: one turn per request, no slot held between turns."""

    name = "chat"
    #: The connection serves one request, then ends (legacy /ws/chat, HTTP).
    one_request = False
    #: How this dialect's session ids begin.
    id_prefix = "rt_"
    #: Set by the driver before the first message.
    session_id = ""

    def opening(self) -> list[Any]:
        """Messages sent as soon as the connection opens."""
        return []

    def decode(self, message: Any) -> list[Any]:
        """One client message -> chat commands (edge.chat). Raises EdgeError."""
        raise NotImplementedError

    def encode(self, event: Any) -> list[Any]:
        """One turn event (edge.chat) -> the client's messages."""
        raise NotImplementedError

    def error(self, err: EdgeError) -> Any:
        raise NotImplementedError
