"""The edge's side of the fabric's wire: the one module that speaks protobuf and reads gRPC
status codes for the edge's sessions and turns.

It owns
- the requests: AcquireRequest (mode, key claim, resume key), ReattachRequest, the worker
  Session stream's start / unit / close / resume, and the ChatRequest of an edge.chat
  ChatInput;
- the replies read back into domain types: queue positions, unit results, usage, close
  reasons, a chat turn's ChatResponse stream, and the lease's EngineLimits (check_slices);
- the one map from a gRPC status to an edge error (edge.errors): the Acquire/Reattach stream
  (lease_error), a worker's start and resume (start_error, resume_error, retry_on_new_channel),
  a chat turn (chat_error) and the scheduler's admin RPCs (admin_error).

Channels and stubs are edge.fabric's; the calls' lifetimes and the session state machine are
edge.session's.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass

import grpc

from omnifabric.common import limits as engine_limits
from omnifabric.common import modes, session_types, tool_wire
from omnifabric.edge import events as ev
from omnifabric.edge.chat import ChatResult, TurnDelta, TurnEvent, TurnPrefilled, TurnToolCall
from omnifabric.edge.chat_input import AudioPart, ChatInput, ChatMessage, ImagePart, TextPart
from omnifabric.edge.errors import (
    EdgeError,
    InferenceError,
    InvalidPayload,
    QueueCancelled,
    QueueFull,
    ResumeExpired,
    ResumeForbidden,
    ResumeUnknown,
    ServiceUnavailable,
    TooManySessions,
    WorkerConnectFailed,
)
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb

#: What a leased worker's engine accepts (carried by the lease).
EngineLimits = session_types.EngineLimits


@dataclass(frozen=True)
class Lease:
    """A slot the scheduler granted, as wait_for_lease returns it."""

    lease_id: str
    worker_id: str
    worker_address: str
    epoch: int = 0
    """The granting leader's epoch (0 without an election), presented in SessionStart."""
    limits: EngineLimits | None = None
    """What the leased worker's engine accepts; None when the scheduler passed on none
    (older schedulers and workers: the worker alone decides)."""


def lease_from(msg: scheduler_pb.Lease) -> Lease:
    """The scheduler's Lease message -> the domain lease."""
    limits = engine_limits.from_pb(msg.limits) if msg.HasField("limits") else None
    return Lease(msg.lease_id, msg.worker_id, msg.worker_address, msg.epoch, limits)


#: The modes of a duplex session (SessionCore); "chat" is a turn's (run_turn).
DUPLEX_MODES = modes.DUPLEX
_REASONS = {
    ev.USER_STOP: common_pb2.CLOSE_REASON_USER_STOP,
    ev.CLIENT_CLOSED: common_pb2.CLOSE_REASON_CLIENT_CLOSED,
    ev.SERVER_SHUTDOWN: common_pb2.CLOSE_REASON_SERVER_SHUTDOWN,
    ev.ERROR: common_pb2.CLOSE_REASON_ERROR,
}
#: Usage's field names, read from its descriptor once (every result carries a Usage).
_USAGE_FIELDS = tuple(f.name for f in common_pb2.Usage.DESCRIPTOR.fields)


def digest(value: str) -> str:
    """sha256 hex: what the fabric gets of a resume token and of its owner's identity."""
    return hashlib.sha256(value.encode()).hexdigest()


# ---- requests --------------------------------------------------------------------------


def key_claim(request: scheduler_pb.AcquireRequest, owner: str, limit: int) -> None:
    """Let the scheduler hold the API key (`owner`, its digest) to its session limit across
    the fabric: the digest hashed again, and the limit (nothing without either)."""
    if owner and limit:
        request.key = digest(owner)
        request.key_session_limit = limit


def acquire_request(
    mode: str,
    session_id: str,
    owner: str = "",
    key_limit: int = 0,
    resume_token: str = "",
    resume_grace_s: float = 0.0,
) -> scheduler_pb.AcquireRequest:
    """The Acquire of a session of `mode` (audio, video, chat): the key claim, and with a
    `resume_token` the session's resume key and owner (digests) and its resume window."""
    request = scheduler_pb.AcquireRequest(mode=modes.to_pb(mode), session_id=session_id)
    key_claim(request, owner, key_limit)
    if resume_token:
        request.resume_key = digest(resume_token)
        request.owner = digest(owner)
        request.resume_grace_s = resume_grace_s
    return request


def reattach_request(token: str, owner: str) -> scheduler_pb.ReattachRequest:
    """The scheduler's Reattach of the resumable session of `token`, for `owner`."""
    return scheduler_pb.ReattachRequest(resume_key=digest(token), owner=digest(owner))


def config_to(settings: ev.DuplexSettings) -> common_pb2.DuplexConfig:
    """Domain duplex settings -> protobuf (unset fields stay unset; max_slice_nums travels
    as SessionStart.max_slice_nums)."""
    return common_pb2.DuplexConfig(**settings.given())


def start_request(
    lease: Lease,
    session_id: str,
    mode: str,
    init: ev.InitCommand,
    resume_grace_s: float = 0.0,
    client_state: bytes = b"",
    early_results: bool = False,
    speech_cuts: bool = False,
) -> worker_pb.SessionRequest:
    """The worker Session stream's first message: start `session_id` on the lease; a
    resumable session (`resume_grace_s` > 0) also hands over the client's state;
    `early_results`: the client takes output between units (Traits.early_results);
    `speech_cuts`: the edge cuts units short where speech stops (Cadence.speech_cuts)."""
    start = worker_pb.SessionStart(
        lease_id=lease.lease_id,
        epoch=lease.epoch,
        session_id=session_id,
        mode=modes.to_pb(mode),
        system_prompt=init.system_prompt,
        ref_audio_pcm=init.ref_audio,
        tts_ref_audio_pcm=init.tts_ref_audio,
        config=config_to(init.config),
        max_slice_nums=init.max_slice_nums,
        tools=tool_wire.specs_to_pb(init.tools),
    )
    if init.tools:
        start.tool_choice = init.tool_choice.kind
        start.tool_choice_name = init.tool_choice.name
    if resume_grace_s > 0:
        start.resume_grace_s = resume_grace_s
        start.client_state = client_state
    if early_results:
        start.early_results = True
    if speech_cuts:
        start.speech_cuts = True
    return worker_pb.SessionRequest(start=start)


def tool_output_request(cmd: ev.ToolOutputCommand) -> worker_pb.SessionRequest:
    """A function's output on the worker's Session stream."""
    output = common_pb2.ToolOutput(call_id=cmd.call_id, output=cmd.output)
    return worker_pb.SessionRequest(tool_output=output)


def resume_request(lease: Lease) -> worker_pb.SessionRequest:
    """The worker Session stream's first message when taking over a resumable session."""
    return worker_pb.SessionRequest(resume=worker_pb.SessionResume(lease_id=lease.lease_id))


def unit_request(seq: int, cmd: ev.AppendCommand) -> worker_pb.SessionRequest:
    """One unit of input for the worker, numbered `seq`."""
    # Built in place: a Unit message passed to SessionRequest(unit=...) is copied (its
    # 64 KB of PCM too); 7 -> 2 us per unit.
    return worker_pb.SessionRequest(
        unit={
            "seq": seq,
            "pcm": cmd.pcm,
            "frames": cmd.frames,
            "force_listen": cmd.force_listen,
            "max_slice_nums": cmd.max_slice_nums,
        }
    )


def close_request(reason: str) -> worker_pb.SessionRequest:
    """The client's end of the session (`reason`: user_stop, client_closed, ...)."""
    return worker_pb.SessionRequest(close=worker_pb.SessionClose(reason=_REASONS[reason]))


def _part(part: TextPart | ImagePart | AudioPart) -> worker_pb.ContentPart:
    if isinstance(part, TextPart):
        return worker_pb.ContentPart(text=part.text)
    if isinstance(part, ImagePart):
        return worker_pb.ContentPart(image=part.data)
    return worker_pb.ContentPart(audio_pcm=part.pcm)


def _message(m: ChatMessage) -> worker_pb.ChatMessage:
    calls = [tool_wire.call_to_pb(c) for c in m.tool_calls]
    return worker_pb.ChatMessage(
        role=m.role,
        parts=[_part(p) for p in m.parts],
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
    )


def chat_request(chat: ChatInput, lease_id: str, session_id: str) -> worker_pb.ChatRequest:
    """A validated chat request (edge.chat.parse_chat) -> the worker's ChatRequest for the
    turn on `lease_id`. Options the client left out stay unset (the worker's defaults)."""
    request = worker_pb.ChatRequest(
        lease_id=lease_id,
        session_id=session_id,
        messages=[_message(m) for m in chat.messages],
        tools=tool_wire.specs_to_pb(chat.tools),
    )
    if chat.tools:
        request.tool_choice = chat.tool_choice.kind
        request.tool_choice_name = chat.tool_choice.name
    gen = request.generation
    for name, value in chat.generation.__dict__.items():
        if value is not None:
            setattr(gen, name, value)
    tts = request.tts
    tts.enabled = chat.tts.enabled
    tts.mode = chat.tts.mode
    if chat.tts.ref_audio:
        tts.ref_audio_pcm = chat.tts.ref_audio
    if chat.tts.language is not None:
        tts.language = chat.tts.language
    image = request.image
    if chat.image.max_slice_nums is not None:
        image.max_slice_nums = chat.image.max_slice_nums
    if chat.image.use_image_id is not None:
        image.use_image_id = chat.image.use_image_id
    request.omni_mode = chat.omni_mode
    request.enable_thinking = chat.enable_thinking
    return request


# ---- replies -----------------------------------------------------------------------------


def queued_from(msg: scheduler_pb.QueuePosition, first: bool) -> ev.Queued:
    """A queue position from the Acquire stream -> the domain event."""
    return ev.Queued(msg.position, msg.queue_length, msg.estimated_wait_s, msg.ticket_id, first)


def acquire_reply(response: scheduler_pb.AcquireResponse, first: bool) -> ev.Queued | Lease | None:
    """An Acquire (or Reattach) stream message before the grant: a queue position, the
    lease, or None (the worker was lost before the session started)."""
    kind = response.WhichOneof("kind")
    if kind == "queued":
        return queued_from(response.queued, first)
    if kind == "lease":
        return lease_from(response.lease)
    return None


def queued_position(response: scheduler_pb.AcquireResponse) -> int | None:
    """The queue position an Acquire stream message carries (None: it carries none)."""
    return response.queued.position if response.WhichOneof("kind") == "queued" else None


def reason_name(value: int) -> str:
    """CloseReason enum value -> reason name (user_stop, timeout, ...)."""
    if value == common_pb2.CLOSE_REASON_UNSPECIFIED:
        return ev.ERROR
    return common_pb2.CloseReason.Name(value).removeprefix("CLOSE_REASON_").lower()


def usage_from(msg: common_pb2.Usage) -> ev.Usage:
    """Protobuf usage -> domain usage."""
    return ev.Usage(**{name: getattr(msg, name) for name in _USAGE_FIELDS})


def output_from(result: worker_pb.UnitResult) -> ev.Output:
    """A worker's UnitResult -> the domain output event."""
    t = result.timings
    timings = {
        "prefill_ms": t.prefill_ms,
        "generate_ms": t.generate_ms,
        "finalize_wait_ms": t.finalize_wait_ms,
        "wall_clock_ms": t.wall_clock_ms,
        "queue_ms": t.queue_ms,
        "engine_busy_ms": t.engine_busy_ms,
    }
    timings.update({f"cost_{k}_ms": v for k, v in t.engine_costs_ms.items()})
    return ev.Output(
        seq=result.seq,
        is_listen=result.is_listen,
        text=result.text,
        pcm=result.pcm,
        end_of_turn=result.end_of_turn,
        kv_cache_length=result.kv_cache_length,
        timings_ms=timings,
        usage=usage_from(result.usage),
        dropped_seqs=tuple(result.dropped_seqs),
        n_tokens=result.n_tokens,
        n_tts_tokens=result.n_tts_tokens,
        input_transcript=result.input_transcript,
        audio_dropped=result.audio_dropped,
        pruned=result.pruned,
        tool_calls=tuple(tool_wire.call_from_pb(c) for c in result.tool_calls),
        early=result.early,
    )


@dataclass(frozen=True)
class WorkerStarted:
    """The worker started the session (its SessionStarted)."""

    prompt_length: int
    notes: tuple[str, ...]
    unit_samples: tuple[int, int] | None
    """(fewest, most) samples a unit may have on this worker; None from older workers."""
    unit_timeout_ms: int
    duration_left_ms: int
    units_as_sent: bool = False
    """The engine takes units as they come (not re-chunked into its own); False from older
    workers."""


@dataclass(frozen=True)
class WorkerResumed:
    """The worker took the session back on this stream (its SessionResumed); `replay_count`
    results follow."""

    session_id: str
    prompt_length: int
    notes: tuple[str, ...]
    client_state: bytes
    last_unit_seq: int
    replay_count: int
    unit_samples: tuple[int, int] | None
    unit_timeout_ms: int
    duration_left_ms: int
    units_as_sent: bool = False


@dataclass(frozen=True)
class Buffered:
    """The worker kept unit `seq`'s audio for its next model unit (and dropped these)."""

    seq: int
    dropped_seqs: tuple[int, ...]


@dataclass(frozen=True)
class WorkerEnded:
    """The worker ended the session (its SessionEnded)."""

    reason: str
    message: str
    error_code: str
    usage: ev.Usage | None


#: What the worker's Session stream says, read into domain types (worker_event).
WorkerEvent = WorkerStarted | WorkerResumed | Buffered | ev.Output | WorkerEnded


def worker_event(response: worker_pb.SessionResponse) -> WorkerEvent | None:
    """A worker Session stream response -> its domain event (None: a kind this edge does
    not know, from a newer worker)."""
    kind = response.WhichOneof("kind")
    if kind == "result":
        result = response.result
        if result.buffered:
            return Buffered(result.seq, tuple(result.dropped_seqs))
        return output_from(result)
    if kind == "ended":
        e = response.ended
        usage = usage_from(e.usage) if e.HasField("usage") else None
        return WorkerEnded(reason_name(e.reason), e.message, e.error_code, usage)
    if kind == "started":
        s = response.started
        return WorkerStarted(
            s.prompt_length,
            tuple(s.notes),
            _unit_samples(s.min_unit_samples, s.max_unit_samples),
            s.unit_timeout_ms,
            s.duration_left_ms,
            s.units_as_sent,
        )
    if kind == "resumed":
        r = response.resumed
        return WorkerResumed(
            r.session_id,
            r.prompt_length,
            tuple(r.notes),
            r.client_state,
            r.last_unit_seq,
            r.replay_count,
            _unit_samples(r.min_unit_samples, r.max_unit_samples),
            r.unit_timeout_ms,
            r.duration_left_ms,
            r.units_as_sent,
        )
    return None


#: What the Acquire stream says of a granted lease after the grant (lease_news).
LEASE_LOST = "lost"
LEASE_MOVED = "moved"


def lease_news(response: scheduler_pb.AcquireResponse) -> str:
    """An Acquire stream message after the lease: LEASE_LOST (its worker is gone),
    LEASE_MOVED (another holder resumed the session), else ""."""
    kind = response.WhichOneof("kind")
    if kind == "lease_lost":
        return LEASE_LOST
    if kind == "lease_moved":
        return LEASE_MOVED
    return ""


def _unit_samples(fewest: int, most: int) -> tuple[int, int] | None:
    return (fewest, most) if most else None  # older workers send none


def check_slices(limits: EngineLimits | None, value: int, what: str = "max_slice_nums") -> None:
    """A max_slice_nums (0: unset) against the leased worker's range, by common's one slice
    rule; nothing to check without limits. Raises InvalidPayload naming the range."""
    if not value or limits is None or not limits.max_slice_nums:
        return
    refusal = limits.slices_refusal(value, what, taker="this server")
    if refusal:
        raise InvalidPayload(refusal)


async def read_chat(
    call: AsyncIterable[worker_pb.ChatResponse],
    emit: Callable[[TurnEvent], Awaitable[None]],
    result: ChatResult,
    notes: tuple[str, ...] = (),
) -> None:
    """Read a worker's Chat stream into `result`, emitting TurnPrefilled and TurnDelta;
    the turn's `notes` follow the worker's own ignored fields. Raises the turn's errors
    (chat_error) when the call fails."""
    try:
        async for response in call:
            kind = response.WhichOneof("kind")
            if kind == "prefilled":
                await emit(TurnPrefilled(response.prefilled.input_tokens))
            elif kind == "delta":
                result.audio.append(response.delta.pcm)
                await emit(TurnDelta(response.delta.text, response.delta.pcm))
            elif kind == "tool_call":
                made = tool_wire.call_from_pb(response.tool_call)
                result.tool_calls.append(made)
                await emit(TurnToolCall(made))
            elif kind == "done":
                d = response.done
                result.text, result.reason = d.text, d.reason or "turn_end"
                result.input_tokens, result.generated_tokens = d.input_tokens, d.generated_tokens
                result.usage = usage_from(d.usage)
                result.ignored = tuple(d.ignored) + notes
                result.timings_ms.update(prefill_ms=d.prefill_ms, generate_ms=d.generate_ms)
    except grpc.aio.AioRpcError as err:
        raise chat_error(err) from None


# ---- gRPC status -> edge error -------------------------------------------------------------

#: The scheduler's refusal of a key at its fabric-wide session limit starts so
#: (scheduler.errors.KeySessionLimit).
KEY_LIMIT_PREFIX = "key_session_limit:"
#: Reattach's refusals ("resume_<why>: <text>").
_RESUME_ERRORS: dict[grpc.StatusCode, type[EdgeError]] = {
    grpc.StatusCode.NOT_FOUND: ResumeUnknown,
    grpc.StatusCode.FAILED_PRECONDITION: ResumeExpired,
    grpc.StatusCode.PERMISSION_DENIED: ResumeForbidden,
}


def _from_scheduler(err: grpc.aio.AioRpcError) -> bool:
    """True when the status came from the scheduler's handlers, not from the transport."""
    return any(
        key == "omni-error-source" and value == "scheduler"
        for key, value in (err.trailing_metadata() or ())
    )


def lease_error(err: grpc.aio.AioRpcError) -> EdgeError:
    """An Acquire or Reattach stream's failure -> QueueFull, TooManySessions, ResumeUnknown,
    ResumeExpired, ResumeForbidden, QueueCancelled or ServiceUnavailable."""
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details = err.details() or ""
        if details.startswith(KEY_LIMIT_PREFIX) and _from_scheduler(err):
            return TooManySessions(details.partition(": ")[2])
        return QueueFull("the queue is full, try again later")
    resume_error = _RESUME_ERRORS.get(code)
    if resume_error is not None and _from_scheduler(err):
        return resume_error((err.details() or "").partition(": ")[2] or "refused")
    if code == grpc.StatusCode.ABORTED and _from_scheduler(err):
        return QueueCancelled("an operator removed this request from the queue")
    if code == grpc.StatusCode.UNAVAILABLE and _from_scheduler(err):
        # The scheduler's own refusal: no worker for the mode, or shutting down.
        return ServiceUnavailable(err.details() or "no worker available")
    # Transport failures: their details name addresses and are not for clients.
    return ServiceUnavailable("the scheduler cannot be reached")


def retry_on_new_channel(err: grpc.aio.AioRpcError) -> bool:
    """The transport, not the worker, failed a session's start before any answer (a
    connection that died with a cut link): worth once more on a fresh channel."""
    return err.code() == grpc.StatusCode.UNAVAILABLE


def start_error(err: grpc.aio.AioRpcError) -> EdgeError:
    """A worker's refusal (or loss) of a session's start. A refusal of the client's
    settings (INVALID_ARGUMENT: watermarks past the worker's context, which only it knows)
    is the client's error, not the server's: it ends the session (1008), and retrying the
    same settings cannot help, as WorkerConnectFailed's 1013 would say."""
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPayload(err.details() or "the worker refused the settings", close_code=1008)
    return WorkerConnectFailed(f"the worker did not start the session: {err.details()}")


def resume_error(err: grpc.aio.AioRpcError) -> EdgeError:
    """A worker's refusal (or loss) of a session's resume: ResumeExpired when the session is
    no longer on it, else WorkerConnectFailed."""
    if err.code() == grpc.StatusCode.NOT_FOUND:
        return ResumeExpired("the session is no longer on its worker")
    return WorkerConnectFailed(f"the worker did not resume: {err.details()}")


def chat_error(err: grpc.aio.AioRpcError) -> EdgeError:
    """A worker's failure of a chat turn: InvalidPayload (the request), InferenceError (the
    engine) or WorkerConnectFailed (anything else)."""
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPayload(err.details() or "invalid chat request")
    if err.code() == grpc.StatusCode.INTERNAL:
        return InferenceError(err.details() or "inference failed")
    return WorkerConnectFailed(f"the worker failed the turn: {err.details()}")
