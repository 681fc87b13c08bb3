"""RealtimeService.Connect: the public session events in protobuf, for internal gRPC
clients. Audio travels as raw bytes; everything the JSON dialects report (queue events,
per-unit timings with the engine's own costs, token counts, usage, the server's reason
for an end) is in the responses.

The first request must be `init` (its mode picks the session's); a bad first request ends
the call with INVALID_ARGUMENT. Errors that end a session end the call: RESOURCE_EXHAUSTED
for a full queue or a client too slow to read (`slow_client`), UNAVAILABLE for no service
or a worker that did not start, INTERNAL with a generic text for anything unexpected;
client mistakes during a session arrive as `error` responses and the stream stays usable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnifabric.common import modes, tool_wire
from omnifabric.edge import events as ev
from omnifabric.edge import fields, pcm
from omnifabric.edge.dialects.base import DuplexDialect, Refusal, Traits
from omnifabric.edge.errors import (
    AppDisabled,
    EdgeError,
    InferenceError,
    InternalError,
    InvalidPayload,
    MissingField,
    QueueCancelled,
    QueueFull,
    ResumeExpired,
    ResumeForbidden,
    ResumeUnknown,
    SlowClient,
    TooManySessions,
)
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb

#: Fatal errors -> the call's status; any other fatal error is UNAVAILABLE.
_STATUS = {
    AppDisabled: "PERMISSION_DENIED",
    QueueCancelled: "ABORTED",
    QueueFull: "RESOURCE_EXHAUSTED",
    TooManySessions: "RESOURCE_EXHAUSTED",
    SlowClient: "RESOURCE_EXHAUSTED",
    InvalidPayload: "INVALID_ARGUMENT",  # an init outside the leased worker's limits
    ResumeUnknown: "NOT_FOUND",
    ResumeExpired: "FAILED_PRECONDITION",
    ResumeForbidden: "PERMISSION_DENIED",
}
#: A first request the call cannot start from.
_BAD_START = 1008


def settings_from(msg: common_pb2.DuplexConfig, where: str = "init.config") -> ev.DuplexSettings:
    """Protobuf duplex config -> domain settings (unset fields stay None), checked by the
    JSON dialects' rules (``fields.duplex_settings``: ranges, finite numbers), so a NaN
    temperature or a top_p of 5 is refused here as it is there."""
    given = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields if msg.HasField(f.name)}
    half_duplex = given.pop("half_duplex", None)
    settings = fields.duplex_settings(given, where)
    return dataclasses.replace(settings, half_duplex=half_duplex)


def usage_to(usage: ev.Usage) -> common_pb2.Usage:
    """Domain usage -> protobuf usage."""
    return common_pb2.Usage(**usage.__dict__)


def init_command(msg: rt_pb.SessionInit) -> ev.InitCommand:
    try:
        tools = tool_wire.specs_from_pb(msg.tools, "init.tools")
        choice = tool_wire.choice_from(msg.tool_choice, msg.tool_choice_name, tools)
    except ValueError as exc:
        raise InvalidPayload(str(exc)) from None
    return ev.InitCommand(
        dialect=ev.Dialect.CURRENT,
        system_prompt=msg.system_prompt,
        config=settings_from(msg.config),
        ref_audio=pcm.reference_pcm(msg.ref_audio, "ref_audio") if msg.ref_audio else b"",
        tts_ref_audio=(
            pcm.reference_pcm(msg.tts_ref_audio, "tts_ref_audio") if msg.tts_ref_audio else b""
        ),
        max_slice_nums=msg.max_slice_nums or 1,
        tools=tools,
        tool_choice=choice,
        early_results=msg.early_results,
        speech_cuts=msg.speech_cuts,
    )


def append_command(msg: rt_pb.InputAppend) -> ev.AppendCommand:
    if not msg.audio:
        raise MissingField("'audio' is required")
    fields.frame_list(list(msg.video_frames), "video_frames")
    for i, frame in enumerate(msg.video_frames):
        pcm.check_jpeg(frame, f"video_frames[{i}]")
    return ev.AppendCommand(
        pcm=pcm.check_unit_pcm(msg.audio),
        frames=tuple(msg.video_frames),
        force_listen=msg.force_listen,
        max_slice_nums=msg.max_slice_nums,
    )


def timings_to(timings_ms: dict[str, float]) -> common_pb2.UnitTimings:
    """The unit's timings, the engine's per-phase costs (`cost_<phase>_ms`) included."""
    t = timings_ms
    return common_pb2.UnitTimings(
        prefill_ms=t.get("prefill_ms", 0.0),
        generate_ms=t.get("generate_ms", 0.0),
        finalize_wait_ms=t.get("finalize_wait_ms", 0.0),
        wall_clock_ms=t.get("wall_clock_ms", 0.0),
        queue_ms=t.get("queue_ms", 0.0),
        engine_busy_ms=t.get("engine_busy_ms", 0.0),
        engine_costs_ms={
            k.removeprefix("cost_").removesuffix("_ms"): v
            for k, v in t.items()
            if k.startswith("cost_") and k.endswith("_ms")
        },
    )


def reason_value(name: str) -> common_pb2.CloseReason:
    """A close reason name -> the CloseReason enum value."""
    return common_pb2.CloseReason.Value("CLOSE_REASON_" + name.upper())


class GrpcRealtime(DuplexDialect):
    """RealtimeService.Connect."""

    name = "grpc_realtime"
    traits = Traits(
        holds_input_until_started=True,
        already_initialized="init may be sent only once",
        resumable=True,
    )

    def __init__(self) -> None:
        self._opened = False
        """The first request (init or resume) was accepted."""
        self._event_seq = 0
        self._awaited: set[str] = set()
        """The ids of the model's calls sent (OutputUnit.tool_calls) whose output has not
        come yet."""

    def not_ready(self, cmd: ev.Command) -> str:
        return "send init first"

    def init_refused(self, err: EdgeError) -> EdgeError:
        # The call's one init: a refused one ends the call (INVALID_ARGUMENT).
        return type(err)(err.message, close_code=_BAD_START)

    def decode(self, message: rt_pb.ConnectRequest) -> list[ev.Command]:
        kind = message.WhichOneof("kind")
        if not self._opened:
            if kind == "resume":
                resume = message.resume
                mode = modes.name(resume.mode)
                if mode not in modes.DUPLEX or not resume.resume_token:
                    raise InvalidPayload(
                        "resume needs mode AUDIO or VIDEO and the resume_token",
                        close_code=_BAD_START,
                    )
                self.mode, self._opened = mode, True
                self.resume_token, self.last_seq = resume.resume_token, resume.last_seq
                return []
            if kind != "init":
                raise InvalidPayload("the first request must be init", close_code=_BAD_START)
            mode = modes.name(message.init.mode)
            if mode not in modes.DUPLEX:
                raise InvalidPayload("init.mode must be AUDIO or VIDEO", close_code=_BAD_START)
            try:
                init = init_command(message.init)
            except EdgeError as err:
                raise InvalidPayload(err.message, close_code=_BAD_START) from None
            self.mode, self._opened = mode, True
            return [init]
        if kind == "append":
            return [append_command(message.append)]
        if kind == "close":
            return [ev.CloseCommand(message.close.reason or None)]
        if kind == "tool_output":
            output = message.tool_output
            if not output.call_id:
                raise MissingField("'tool_output.call_id' is required")
            if output.call_id not in self._awaited:
                shown = fields.shown(output.call_id)
                raise InvalidPayload(
                    f"tool_output.call_id {shown}: no call of the model with that id awaits "
                    "its output"
                )
            self._awaited.discard(output.call_id)
            return [ev.ToolOutputCommand(output.call_id, output.output)]
        if kind == "init":
            raise InvalidPayload(self.traits.already_initialized)
        if kind == "resume":
            raise InvalidPayload("resume may only be the first request of a call")
        raise InvalidPayload("an empty request")

    def _numbered(self, responses: list[Any]) -> list[Any]:
        for response in responses:
            self._event_seq += 1
            response.event_seq = self._event_seq
        return responses

    def replay(self, event: ev.Reattached) -> list[Any]:
        """`resumed`, then the outputs after last_seq (session created is 1, each output
        one more)."""
        self.session_id = event.session_id
        self._event_seq = 1
        missed = []
        for out in event.outputs:
            [response] = self._numbered(self._output(out))
            if response.event_seq <= self.last_seq:
                continue
            if out.audio_dropped or out.pruned:
                raise ResumeExpired(
                    f"events after seq {self.last_seq} are no longer kept: resume sooner"
                )
            missed.append(response)
        resumed = rt_pb.ResumedEvent(
            session_id=event.session_id,
            last_seq=self.last_seq,
            replayed=len(missed),
            last_input_seq=event.last_input_seq,
            resume_token=event.resume_token,
            resume_window_s=event.resume_window_s,
        )
        return [rt_pb.ConnectResponse(resumed=resumed), *missed]

    def _output(self, event: ev.Output) -> list[rt_pb.ConnectResponse]:
        self._awaited.update(c.call_id for c in event.tool_calls)
        output = rt_pb.OutputUnit(
            seq=event.seq,
            is_listen=event.is_listen,
            text=event.text,
            audio=event.pcm,
            end_of_turn=event.end_of_turn,
            kv_cache_length=event.kv_cache_length,
            timings=timings_to(event.timings_ms),
            usage=usage_to(event.usage),
            dropped_seqs=list(event.dropped_seqs),
            input_transcript=event.input_transcript,
            n_tokens=event.n_tokens,
            n_tts_tokens=event.n_tts_tokens,
            tool_calls=[tool_wire.call_to_pb(c) for c in event.tool_calls],
            early=event.early,
        )
        return [rt_pb.ConnectResponse(output=output)]

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        if isinstance(event, ev.Queued):
            q = rt_pb.QueueEvent(
                position=event.position,
                estimated_wait_s=event.estimated_wait_s,
                ticket_id=event.ticket_id,
                queue_length=event.queue_length,
            )
            first = event.first
            return [
                rt_pb.ConnectResponse(queued=q) if first else rt_pb.ConnectResponse(queue_update=q)
            ]
        if isinstance(event, ev.QueueDone):
            return [rt_pb.ConnectResponse(queue_done=rt_pb.QueueDone())]
        if isinstance(event, ev.Created):
            created = rt_pb.SessionCreated(
                session_id=event.session_id,
                prompt_length=event.prompt_length,
                notes=list(event.notes),
                resume_token=event.resume_token,
                resume_window_s=event.resume_window_s,
            )
            return self._numbered([rt_pb.ConnectResponse(created=created)])
        if isinstance(event, ev.Output):
            return self._numbered(self._output(event))
        if isinstance(event, ev.Closed):
            sent = []
            if event.error_code == InferenceError.code:
                sent.append(self.error(InferenceError(event.message or "inference failed")))
            value = reason_value(event.reason)
            closed = rt_pb.SessionClosed(
                session_id=self.session_id or "",
                reason=value,
                reason_text=event.client_reason or event.reason,
                usage=usage_to(event.usage),
                message=event.message,
            )
            sent.append(rt_pb.ConnectResponse(closed=closed))
            return self._numbered(sent)
        if isinstance(event, ev.Expiring):
            expiring = rt_pb.SessionExpiring(seconds_left=event.seconds_left)
            return [rt_pb.ConnectResponse(expiring=expiring)]
        return []

    def error(self, err: EdgeError) -> rt_pb.ConnectResponse | Refusal:
        if isinstance(err, InternalError):
            return Refusal("INTERNAL", "internal error")
        if not self._opened:  # the first request: nothing started
            return Refusal("INVALID_ARGUMENT", err.message)
        if err.close_code is not None:
            return Refusal(_STATUS.get(type(err), "UNAVAILABLE"), f"{err.code}: {err.message}")
        return rt_pb.ConnectResponse(
            error=rt_pb.ErrorEvent(code=err.code, message=err.message, type=err.kind)
        )
