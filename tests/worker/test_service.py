"""WorkerService.Session through real gRPC servers: the unit loop, limits, leases, drain."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnifabric.common import close_reasons
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb
from omnifabric.worker.engine import EngineLimits
from omnifabric.worker.engines.synthetic import SyntheticEngine, SyntheticSession
from tests.conftest import scaled
from tests.worker.conftest import SILENCE, SPEECH, SessionClient, pcm_bytes
from tests.worker.test_faults import report_where


class RecordingSession(SyntheticSession):
    """A synthetic session that records the order of engine calls."""

    engine: RecordingEngine

    def prefill(self, pcm, frames, max_slice_nums):
        self.engine.calls.append("prefill")
        self.engine.speech_cuts.append(self.speech_cuts)
        return super().prefill(pcm, frames, max_slice_nums)

    def generate(self, force_listen):
        self.engine.calls.append("generate")
        if self.units + 1 == self.engine.fail_at:
            raise RuntimeError("secret internal detail")
        return super().generate(force_listen)

    def finalize(self):
        time.sleep(self.engine.finalize_s)
        self.engine.calls.append("finalize")
        super().finalize()

    def close(self):
        self.engine.calls.append("close")
        self.engine.closed.set()
        super().close()


class RecordingEngine(SyntheticEngine):
    session_class = RecordingSession

    def __init__(self, finalize_s: float = 0.0, fail_at: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.finalize_s = finalize_s
        self.fail_at = fail_at
        self.calls: list[str] = []
        self.speech_cuts: list[bool] = []
        """EngineSession.speech_cuts at each prefill."""
        self.closed = threading.Event()
        self.warm_gate = threading.Event()
        self.warm_gate.set()

    def warmup(self):
        self.warm_gate.wait(10)
        result = super().warmup()
        self.calls.clear()
        self.speech_cuts.clear()
        self.closed.clear()
        return result


async def open_session(workers, worker, lease_id="L1", grant=True, **start_fields):
    if grant:
        workers.scheduler.grant(worker.worker_id, lease_id)
    client = SessionClient(workers.stub(worker))
    client.start(lease_id, **start_fields)
    started = await client.next()
    assert started.WhichOneof("kind") == "started", started
    return client, started.started


async def serve_units(client, seqs, pcms=None):
    """Send units one by one, each after the previous result; returns the results."""
    results = []
    for i, seq in enumerate(seqs):
        client.unit(seq, pcms[i] if pcms else SILENCE)
        response = await client.next()
        assert response.WhichOneof("kind") == "result", response
        results.append(response.result)
    return results


async def test_full_session(workers):
    worker = await workers.start()
    client, started = await open_session(workers, worker, system_prompt="x" * 40)
    assert (started.session_id, started.worker_id, started.prompt_length) == ("s-L1", "w1", 23)
    # The worker owns the unit lengths it serves and tells the sender.
    assert (started.min_unit_samples, started.max_unit_samples) == (4000, 64000)
    assert started.units_as_sent  # the synthetic engine takes units as they come
    pcms = [SILENCE, SILENCE, SILENCE, SPEECH, SILENCE, SILENCE]
    results = await serve_units(client, range(1, 7), pcms)
    assert [r.seq for r in results] == [1, 2, 3, 4, 5, 6]
    assert [r.is_listen for r in results] == [True, True, True, True, False, False]
    assert results[4].text == "reply 1 part 1 " and len(results[4].pcm) > 0
    assert np.frombuffer(results[5].pcm, dtype="<f4").size == 24000
    for r in results:
        t = r.timings
        assert t.prefill_ms > 0 and t.generate_ms > 0 and t.wall_clock_ms >= t.prefill_ms
        assert t.queue_ms >= 0 and t.finalize_wait_ms >= 0 and "llm" in t.engine_costs_ms
    assert [r.usage.input_audio_tokens for r in results] == [10, 20, 30, 40, 50, 60]
    assert results[-1].usage.input_text_tokens == 23
    assert results[-1].usage.output_tokens > 0
    assert results[-1].usage.total_tokens == (
        results[-1].usage.input_tokens + results[-1].usage.output_tokens
    )
    client.close()
    (ended,) = await client.until_ended()
    assert ended.ended.reason == common_pb2.CLOSE_REASON_USER_STOP
    assert (ended.ended.units_served, ended.ended.units_dropped) == (6, 0)
    assert ended.ended.usage == results[-1].usage
    assert await workers.scheduler.next_released() == "L1"


async def test_first_request_must_be_start(workers):
    worker = await workers.start()
    client = SessionClient(workers.stub(worker))
    client.unit(1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.next()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_lease_is_not_found(workers):
    worker = await workers.start(lease_wait_s=0.2)
    client = SessionClient(workers.stub(worker))
    client.start("nope")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.next()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_lease_used_twice_is_failed_precondition(workers):
    worker = await workers.start()
    first, _ = await open_session(workers, worker)
    second = SessionClient(workers.stub(worker))
    second.start("L1")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await second.next()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await serve_units(first, [1])


async def test_mode_mismatch_is_refused(workers):
    worker = await workers.start()
    workers.scheduler.grant(worker.worker_id, "L1", mode=common_pb2.MODE_VIDEO)
    client = SessionClient(workers.stub(worker))
    client.start("L1", mode=common_pb2.MODE_AUDIO)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.next()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_lease_granted_after_the_session_opens(workers):
    worker = await workers.start(lease_wait_s=2.0)
    client = SessionClient(workers.stub(worker))
    client.start("late")
    await asyncio.sleep(0.2)
    workers.scheduler.grant(worker.worker_id, "late")
    assert (await client.next()).WhichOneof("kind") == "started"
    await serve_units(client, [1])


async def test_newest_unit_wins(workers):
    worker = await workers.start(synthetic_compute_ms=200)
    client, _ = await open_session(workers, worker)
    for seq in range(1, 6):
        client.unit(seq)
    results = []
    while not results or results[-1].seq != 5:
        response = await client.next()
        assert response.WhichOneof("kind") == "result"
        results.append(response.result)
    client.close()
    (ended,) = await client.until_ended()
    answered = [r.seq for r in results]
    dropped = [seq for r in results for seq in r.dropped_seqs]
    assert len(answered) < 5
    assert sorted(answered + dropped) == [1, 2, 3, 4, 5]
    assert ended.ended.units_dropped == len(dropped)
    assert ended.ended.units_served == len(answered)


async def test_deferred_finalize_runs_before_the_next_prefill(workers):
    engine = RecordingEngine(finalize_s=0.1, compute_ms=2)
    worker = await workers.start(engine=engine)
    client, _ = await open_session(workers, worker)
    results = await serve_units(client, [1, 2, 3])
    # Each result was sent before its finalize ran, so the next unit waited for it.
    assert all(r.timings.finalize_wait_ms > 20 for r in results[1:])
    client.close()
    await client.until_ended()
    assert engine.calls == [
        "prefill", "generate", "finalize",
        "prefill", "generate", "finalize",
        "prefill", "generate", "finalize",
        "close",
    ]  # fmt: skip


async def test_the_senders_speech_cuts_reach_the_engine_session(workers):
    """SessionStart.speech_cuts (the edge's paced cadence cuts units where speech stops)
    is the engine session's speech_cuts before its first unit; off unless said."""
    engine = RecordingEngine(compute_ms=1)
    worker = await workers.start(engine=engine)
    for lease, cuts in (("L1", True), ("L2", False)):
        fields = {"speech_cuts": True} if cuts else {}
        client, _ = await open_session(workers, worker, lease_id=lease, **fields)
        await serve_units(client, [1, 2])
        client.close()
        await client.until_ended()
    assert engine.speech_cuts == [True, True, False, False]


async def test_duration_limit_ends_with_timeout(workers):
    worker = await workers.start(audio_limit_s=1.0)
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    began = time.monotonic()
    (ended,) = await client.until_ended(timeout=3)
    assert ended.ended.reason == common_pb2.CLOSE_REASON_TIMEOUT
    assert time.monotonic() - began < scaled(1.5)
    assert await workers.scheduler.next_released() == "L1"


async def test_context_limit_sends_the_result_then_context_full(workers):
    worker = await workers.start()
    client, _ = await open_session(
        workers, worker, config=common_pb2.DuplexConfig(max_kv_tokens=60)
    )
    for seq in range(1, 5):
        client.unit(seq)
        if seq < 4:
            assert (await client.next()).result.kv_cache_length == 13 + 13 * seq
    responses = await client.until_ended()
    assert [r.WhichOneof("kind") for r in responses] == ["result", "ended"]
    assert responses[0].result.kv_cache_length == 65
    assert responses[1].ended.reason == common_pb2.CLOSE_REASON_CONTEXT_FULL


async def test_engine_failure_ends_with_error_and_the_worker_keeps_serving(workers):
    engine = RecordingEngine(fail_at=2, compute_ms=2)
    worker = await workers.start(engine=engine)
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    client.unit(2)
    (ended,) = await client.until_ended()
    assert ended.ended.reason == common_pb2.CLOSE_REASON_ERROR
    assert "secret" not in ended.ended.message
    assert await workers.scheduler.next_released() == "L1"
    assert engine.closed.is_set()
    engine.fail_at = None
    again, _ = await open_session(workers, worker, lease_id="L2")
    await serve_units(again, [1, 2])


async def test_bad_unit_ends_with_error(workers):
    worker = await workers.start()
    client, _ = await open_session(workers, worker)
    client.unit(1, pcm_bytes(seconds=0.1))
    (ended,) = await client.until_ended()
    assert ended.ended.reason == common_pb2.CLOSE_REASON_ERROR
    assert "samples" in ended.ended.message


async def test_client_cancel_frees_the_session_and_releases_the_lease(workers):
    engine = RecordingEngine(compute_ms=2)
    worker = await workers.start(engine=engine)
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    began = time.monotonic()
    client.cancel()
    assert await workers.scheduler.next_released(timeout=1.0) == "L1"
    assert time.monotonic() - began < scaled(1.0)
    assert engine.closed.is_set()
    assert not worker.runtime.sessions


async def test_client_half_close_ends_with_client_closed(workers):
    worker = await workers.start()
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    client.half_close()
    (ended,) = await client.until_ended()
    assert ended.ended.reason == common_pb2.CLOSE_REASON_CLIENT_CLOSED


async def test_lease_revoked_ends_the_session_and_releases_it(workers):
    worker = await workers.start()
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    workers.scheduler.revoke(worker.worker_id, "L1")
    (ended,) = await client.until_ended()
    assert ended.ended.reason == common_pb2.CLOSE_REASON_CLIENT_CLOSED
    assert await workers.scheduler.next_released() == "L1"


async def test_unused_lease_revoked_is_released_at_once(workers):
    worker = await workers.start()
    workers.scheduler.grant(worker.worker_id, "L9")
    await asyncio.sleep(0.05)
    workers.scheduler.revoke(worker.worker_id, "L9")
    assert await workers.scheduler.next_released() == "L9"


async def health_status(worker, service=""):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return response.status


async def test_health_serving_only_after_warmup_and_not_after_drain(workers):
    engine = RecordingEngine(compute_ms=2)
    engine.warm_gate.clear()
    worker = await workers.start(engine=engine, wait=False)
    assert await health_status(worker) == health_pb2.HealthCheckResponse.NOT_SERVING
    hello = await asyncio.wait_for(workers.scheduler.hellos.get(), scaled(3))
    assert hello.health == common_pb2.WORKER_HEALTH_NOT_SERVING
    engine.warm_gate.set()
    await asyncio.wait_for(worker.wait_ready(), scaled(3))
    # The report of the change; a periodic one (every second, with the health of the
    # moment: NOT_SERVING while warming up) may come before it.
    report = await report_where(workers, lambda r: r.health != common_pb2.WORKER_HEALTH_NOT_SERVING)
    assert report.health == common_pb2.WORKER_HEALTH_SERVING
    for service in ("", "omni.realtime.v1.WorkerService"):
        assert await health_status(worker, service) == health_pb2.HealthCheckResponse.SERVING

    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="omni.realtime.v1.WorkerService")
        )
        first = await asyncio.wait_for(anext(aiter(watch)), scaled(3))
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        drain = asyncio.ensure_future(worker.drain_and_stop(grace=1.0))
        second = await asyncio.wait_for(anext(aiter(watch)), scaled(3))
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # Periodic reports still saying SERVING may come before the one of the change.
        report = await report_where(workers, lambda r: r.health != common_pb2.WORKER_HEALTH_SERVING)
        assert report.health == common_pb2.WORKER_HEALTH_NOT_SERVING
        await asyncio.wait_for(drain, scaled(5))


async def test_drain_ends_open_sessions_with_server_shutdown(workers):
    worker = await workers.start()
    clients = []
    for lease_id in ("L1", "L2"):
        client, _ = await open_session(workers, worker, lease_id=lease_id)
        await serve_units(client, [1])
        clients.append(client)
    drain = asyncio.ensure_future(worker.drain_and_stop(grace=2.0))
    for client in clients:
        (ended,) = await client.until_ended()
        assert ended.ended.reason == common_pb2.CLOSE_REASON_SERVER_SHUTDOWN
    assert {await workers.scheduler.next_released() for _ in clients} == {"L1", "L2"}
    await asyncio.wait_for(drain, scaled(5))


@pytest.mark.parametrize(
    "reason, name",
    [
        (common_pb2.CLOSE_REASON_USER_STOP, close_reasons.USER_STOP),
        (common_pb2.CLOSE_REASON_SERVER_SHUTDOWN, close_reasons.SERVER_SHUTDOWN),
        (common_pb2.CLOSE_REASON_CLIENT_CLOSED, close_reasons.CLIENT_CLOSED),
        (common_pb2.CLOSE_REASON_ERROR, close_reasons.ERROR),
    ],
)
async def test_a_close_the_edge_forwards_is_worded_by_its_reason(workers, reason, name):
    """Issue 36: the edge forwards its own closes (a drain's server_shutdown among them);
    each ends with the reason's one sentence, and only the client's stop says the client
    ended it."""
    worker = await workers.start()
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    client.close(reason)
    (ended,) = await client.until_ended()
    assert ended.ended.reason == reason
    assert ended.ended.message == close_reasons.close_message(name)
    by_client = close_reasons.SENTENCES[close_reasons.USER_STOP]
    assert (ended.ended.message == by_client) == (name == close_reasons.USER_STOP)


async def test_reregisters_with_active_leases_after_scheduler_restart(workers):
    worker = await workers.start()
    client, _ = await open_session(workers, worker)
    await serve_units(client, [1])
    port = workers.scheduler.port
    await workers.scheduler.stop()
    await workers.scheduler.start(port)
    hello = await asyncio.wait_for(workers.scheduler.hellos.get(), scaled(5))
    assert hello.worker_id == worker.worker_id
    assert list(hello.active_lease_ids) == ["L1"]
    # The running session was untouched.
    await serve_units(client, [2])
    client.close()
    await client.until_ended()
    assert await workers.scheduler.next_released() == "L1"


async def test_video_session_counts_vision_tokens(workers):
    worker = await workers.start()
    workers.scheduler.grant(worker.worker_id, "V1", mode=common_pb2.MODE_VIDEO)
    client = SessionClient(workers.stub(worker))
    client.start("V1", mode=common_pb2.MODE_VIDEO, max_slice_nums=2)
    assert (await client.next()).WhichOneof("kind") == "started"
    client.requests.put_nowait(
        worker_pb.SessionRequest(unit=worker_pb.Unit(seq=1, pcm=SILENCE, frames=[b"jpeg"]))
    )
    result = (await client.next()).result
    assert result.usage.input_vision_tokens == 128


class WideSlicesEngine(SyntheticEngine):
    """An engine that takes up to 4 slices per frame: its own limits, nothing else."""

    limits = EngineLimits(max_slice_nums=4)


async def test_the_engines_limits_are_advertised_and_enforced(workers, scheduler):
    """The engine's EngineLimits are the one source: the hello carries them (on to the
    scheduler and edges), SessionStarted carries the unit lengths, and the worker refuses
    a max_slice_nums outside them itself, naming the range (for edges that skip the check)."""
    worker = await workers.start(engine=WideSlicesEngine(compute_ms=2, slots=2), wait=False)
    await asyncio.wait_for(worker.wait_ready(), scaled(5))
    hello = await asyncio.wait_for(scheduler.hellos.get(), scaled(5))
    assert hello.HasField("limits")
    assert (hello.limits.min_slice_nums, hello.limits.max_slice_nums) == (1, 4)
    assert (hello.limits.min_unit_samples, hello.limits.max_unit_samples) == (4000, 64000)

    scheduler.grant(worker.worker_id, "V1", mode=common_pb2.MODE_VIDEO)
    refused = SessionClient(workers.stub(worker))
    refused.start("V1", mode=common_pb2.MODE_VIDEO, max_slice_nums=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await refused.next()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "max_slice_nums: 5; this worker takes 1 to 4"

    scheduler.grant(worker.worker_id, "V2", mode=common_pb2.MODE_VIDEO)
    client = SessionClient(workers.stub(worker))
    client.start("V2", mode=common_pb2.MODE_VIDEO, max_slice_nums=4)
    started = (await client.next()).started
    assert (started.min_unit_samples, started.max_unit_samples) == (4000, 64000)
    client.unit(1, frames=[b"jpeg"], max_slice_nums=3)
    assert (await client.next()).WhichOneof("kind") == "result"
    client.unit(2, frames=[b"jpeg"], max_slice_nums=9)
    (ended,) = await client.until_ended()
    assert ended.ended.reason == common_pb2.CLOSE_REASON_ERROR
    assert ended.ended.message == close_reasons.close_message(
        close_reasons.ERROR, "unit 2 max_slice_nums: 9; this worker takes 1 to 4"
    )


async def test_default_limits_refuse_three_slices(workers):
    worker = await workers.start()
    workers.scheduler.grant(worker.worker_id, "V1", mode=common_pb2.MODE_VIDEO)
    client = SessionClient(workers.stub(worker))
    client.start("V1", mode=common_pb2.MODE_VIDEO, max_slice_nums=3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.next()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "max_slice_nums: 3; this worker takes 1 to 2"


async def test_output_token_cap_forces_listening(workers):
    worker = await workers.start()
    client, _ = await open_session(workers, worker, config=common_pb2.DuplexConfig(max_tokens=3))
    pcms = [SILENCE, SILENCE, SILENCE, SPEECH, SILENCE, SILENCE]
    results = await serve_units(client, range(1, 7), pcms)
    assert not results[4].is_listen
    assert results[5].is_listen and results[5].end_of_turn


async def test_refuses_sessions_while_warming_up(workers):
    engine = RecordingEngine(compute_ms=2)
    engine.warm_gate.clear()
    worker = await workers.start(engine=engine, wait=False)
    client = SessionClient(workers.stub(worker))
    client.start("L1")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.next()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    engine.warm_gate.set()
    await asyncio.wait_for(worker.wait_ready(), scaled(3))


def _chat_request(**fields) -> worker_pb.ChatRequest:
    text = worker_pb.ContentPart(text="What's the weather in Paris?")
    fields.setdefault("messages", [worker_pb.ChatMessage(role="user", parts=[text])])
    return worker_pb.ChatRequest(lease_id="C1", **fields)


_WEATHER = common_pb2.ToolSpec(
    name="get_weather",
    description="Get the current weather in a city.",
    parameters_json='{"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}',
)


def test_decode_chat_takes_tools_choice_and_tool_messages():
    from omnifabric.common.tools import FUNCTION, ToolCall
    from omnifabric.worker.service import decode_chat

    call = common_pb2.ToolCall(call_id="call_1", name="get_weather", arguments_json="{}")
    messages = [
        worker_pb.ChatMessage(role="user", parts=[worker_pb.ContentPart(text="weather?")]),
        worker_pb.ChatMessage(role="assistant", tool_calls=[call]),
        worker_pb.ChatMessage(
            role="tool", parts=[worker_pb.ContentPart(text="sunny")], tool_call_id="call_1"
        ),
    ]
    turn = decode_chat(
        _chat_request(
            messages=messages,
            tools=[_WEATHER],
            tool_choice="function",
            tool_choice_name="get_weather",
        )
    )
    (spec,) = turn.tools
    assert spec.name == "get_weather" and spec.parameters["required"] == ["city"]
    assert (turn.tool_choice.kind, turn.tool_choice.name) == (FUNCTION, "get_weather")
    assert turn.messages[1].tool_calls == (ToolCall("call_1", "get_weather", "{}"),)
    assert turn.messages[2].role == "tool" and turn.messages[2].tool_call_id == "call_1"
    assert turn.messages[2].parts == ("sunny",)
    # No tools: an empty tuple and auto, as before.
    plain = decode_chat(_chat_request())
    assert plain.tools == () and plain.tool_choice.kind == "auto"


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"tools": [common_pb2.ToolSpec(name="f", parameters_json='{"type": "string"}')]},
            "tools[0].parameters.type must be object",
        ),
        ({"tools": [common_pb2.ToolSpec(name="f", parameters_json="{oops")]}, "not JSON"),
        (
            {"tools": [common_pb2.ToolSpec(name="f", parameters_json='{"required": "city"}')]},
            "required must be a list",
        ),
        ({"tools": [common_pb2.ToolSpec(name="bad name")]}, "tools[0].name"),
        (
            {"tools": [_WEATHER], "tool_choice": "function", "tool_choice_name": "get_time"},
            "names no function",
        ),
        ({"tool_choice": "function", "tool_choice_name": "get_weather"}, "names no function"),
        ({"tools": [_WEATHER], "tool_choice": "sometimes"}, "tool_choice must be one of"),
    ],
)
def test_decode_chat_refuses_bad_tools(fields, problem):
    from omnifabric.worker.errors import InvalidRequest
    from omnifabric.worker.service import decode_chat

    with pytest.raises(InvalidRequest) as err:
        decode_chat(_chat_request(**fields))
    assert problem in str(err.value)


async def test_chat_streams_the_synthetic_engines_tool_call(workers):
    worker = await workers.start()
    workers.scheduler.grant(worker.worker_id, "C1", mode=common_pb2.MODE_CHAT)
    stub = workers.stub(worker)
    request = _chat_request(tools=[_WEATHER])
    request.tts.enabled = False
    responses = [r async for r in stub.Chat(request, timeout=scaled(10))]
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds == ["prefilled", "tool_call", "done"]
    call = responses[1].tool_call
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.arguments_json == '{"city": "Paris"}'
    assert responses[-1].done.reason == "tool_calls" and responses[-1].done.text == ""
    # The function's output, sent back under a new lease: answered in words with it.
    workers.scheduler.grant(worker.worker_id, "C2", mode=common_pb2.MODE_CHAT)
    request.lease_id = "C2"
    request.messages.add(role="assistant", tool_calls=[call])
    request.messages.add(
        role="tool", parts=[worker_pb.ContentPart(text="18 C, rain")], tool_call_id=call.call_id
    )
    responses = [r async for r in stub.Chat(request, timeout=scaled(10))]
    done = responses[-1].done
    assert done.text == "The result: 18 C, rain" and done.reason == "turn_end"
