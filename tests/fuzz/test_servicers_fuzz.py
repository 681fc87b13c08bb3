"""Fuzzing the protobuf servicers over real gRPC (RELIABILITY.md, Fuzzing): a real
scheduler and a real synthetic worker get arbitrary request messages through the
generated stubs (random field values, and random bytes wherever they parse as the
message): GetStatus, Acquire, a short Register stream, and a short worker Session (a
random start, or one with a real lease, then a few random units).

Only the status codes docs/protocol.md documents may come back, never INTERNAL or UNKNOWN,
and afterwards both servers still answer health checks and serve a normal session.
OMNI_FUZZ_EXAMPLES sets the number of examples (`omnifabric soak --rows FUZZ` runs
10000); the default fits the test suite's budget.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb
from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc
from tests.conftest import scaled
from tests.fuzz import EXAMPLES
from tests.stack import Stack

#: What a servicer may answer (docs/protocol.md, gRPC): INTERNAL/UNKNOWN are bugs.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
}
WORKER_ID = "fuzz-worker"
SLOTS = 2
#: One call's limit: a servicer that hangs fails the property with DEADLINE_EXCEEDED.
CALL_TIMEOUT_S = 5.0
#: One valid unit: 1 s of silence.
GOOD_PCM = np.zeros(16000, "<f4").tobytes()
#: (rpc, status, what came back) -> examples: shows which paths the fuzz reached.
OUTCOMES: Counter[tuple[str, str, str]] = Counter()

_INTS = {
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    # proto3 enums are open: any int32 is a legal value on the wire.
    FieldDescriptor.TYPE_ENUM: st.integers(0, 3) | st.integers(-(2**31), 2**31 - 1),
}


def _scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type in _INTS:
        return _INTS[field.type]
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=24)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64) | st.just(GOOD_PCM)
    assert field.type == FieldDescriptor.TYPE_MESSAGE, field.full_name
    return messages(field.message_type._concrete_class, depth - 1)


@st.composite
def _built(draw, cls: type[Message], depth: int, base: Message | None) -> Message:
    """A message of `cls` with a random subset of its fields set to random values (one
    member per oneof at most); nested messages down to `depth` levels. With a `base`,
    a copy of it with about one field in four replaced: near-valid requests that get
    past the first checks."""
    msg = cls()
    if base is not None:
        msg.CopyFrom(base)
    descriptor = cls.DESCRIPTOR
    chosen_oneofs = {
        oneof.name: draw(st.sampled_from([None, *oneof.fields])) for oneof in descriptor.oneofs
    }
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if base is not None:
            if draw(st.integers(0, 3)) != 3:
                continue
            msg.ClearField(field.name)
        elif oneof is not None and not oneof.name.startswith("_"):
            if chosen_oneofs[oneof.name] is not field:
                continue
        elif not draw(st.booleans()):
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE and depth <= 0:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            entries = draw(st.dictionaries(_scalar(key, depth), _scalar(value, depth), max_size=2))
            getattr(msg, field.name).update(entries)
        elif field.is_repeated:
            values = draw(st.lists(_scalar(field, depth), max_size=3))
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, field.name).extend(values)
            else:
                getattr(msg, field.name)[:] = values
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_scalar(field, depth)))
        else:
            setattr(msg, field.name, draw(_scalar(field, depth)))
    return msg


def _parsed(cls: type[Message], data: bytes) -> Message | None:
    try:
        return cls.FromString(data)
    except (DecodeError, RuntimeError, ValueError):
        return None


def messages(
    cls: type[Message], depth: int = 2, base: Message | None = None
) -> st.SearchStrategy[Message]:
    """Random messages of `cls`: built field by field, `base` with fields replaced, or
    random bytes that parse as it (unknown fields, odd wire types and all)."""
    from_bytes = st.binary(max_size=96).map(lambda b: _parsed(cls, b)).filter(bool)
    if base is None:
        return st.one_of(_built(cls, depth, None), from_bytes)
    return st.one_of(_built(cls, depth, base), _built(cls, depth, None), from_bytes)


@dataclass(frozen=True)
class Plan:
    """One fuzz example: which RPC, and the requests it sends."""

    rpc: str
    requests: tuple[Any, ...]
    real_lease: bool = False
    mode: int = common_pb2.MODE_AUDIO


HELLO = scheduler_pb.WorkerHello(
    worker_id="fuzz-fake",
    address="127.0.0.1:1",
    slots=1,
    modes=[common_pb2.MODE_AUDIO],
    engine="synthetic",
    health=common_pb2.WORKER_HEALTH_SERVING,
)
REGISTER_NEXT = st.one_of(
    messages(scheduler_pb.RegisterRequest),
    messages(scheduler_pb.WorkerReport, base=scheduler_pb.WorkerReport(health=1)).map(
        lambda report: scheduler_pb.RegisterRequest(report=report)
    ),
)
UNITS = st.lists(
    messages(worker_pb.Unit, base=worker_pb.Unit(seq=1, pcm=GOOD_PCM)).map(
        lambda unit: worker_pb.SessionRequest(unit=unit)
    )
    | messages(worker_pb.SessionRequest),
    max_size=3,
)
START = worker_pb.SessionStart(lease_id="fuzz-lease", mode=common_pb2.MODE_AUDIO)
PLANS = st.one_of(
    st.builds(lambda m: Plan("GetStatus", (m,)), messages(scheduler_pb.GetStatusRequest)),
    st.builds(
        lambda m: Plan("Acquire", (m,)),
        messages(scheduler_pb.AcquireRequest, base=scheduler_pb.AcquireRequest(mode=1)),
    ),
    st.builds(
        lambda first, rest: Plan("Register", (first, *rest)),
        messages(scheduler_pb.WorkerHello, base=HELLO).map(
            lambda hello: scheduler_pb.RegisterRequest(hello=hello)
        )
        | messages(scheduler_pb.RegisterRequest),
        st.lists(REGISTER_NEXT, max_size=3),
    ),
    st.builds(
        lambda first, units: Plan("Session", (first, *units)),
        messages(worker_pb.SessionStart, base=START).map(
            lambda start: worker_pb.SessionRequest(start=start)
        )
        | messages(worker_pb.SessionRequest),
        UNITS,
    ),
    st.builds(
        lambda start, units, mode: Plan("Session", (start, *units), True, mode),
        messages(worker_pb.SessionStart, base=START),
        UNITS,
        st.sampled_from([common_pb2.MODE_AUDIO, common_pb2.MODE_VIDEO]),
    ),
)


@dataclass
class Servers:
    """The processes under test and one channel to each."""

    stack: Stack
    worker_address: str
    scheduler: scheduler_grpc.SchedulerServiceStub
    worker: worker_grpc.WorkerServiceStub
    channels: tuple[grpc.Channel, grpc.Channel]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("fuzz"))
    # An unknown lease is answered NOT_FOUND after the grant wait: keep it short.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNI_WORKER_LEASE_WAIT_S", "0.05")
        try:
            stack.start_scheduler()
            stack.start_worker(
                "--slots", str(SLOTS), "--compute-ms", "1", "--engine", "synthetic", name=WORKER_ID
            )
        except Exception:
            stack.stop()
            raise
    worker_address = (
        _status(scheduler_grpc.SchedulerServiceStub(grpc.insecure_channel(stack.scheduler_address)))
        .workers[0]
        .address
    )
    channels = (
        grpc.insecure_channel(stack.scheduler_address),
        grpc.insecure_channel(worker_address),
    )
    try:
        yield Servers(
            stack,
            worker_address,
            scheduler_grpc.SchedulerServiceStub(channels[0]),
            worker_grpc.WorkerServiceStub(channels[1]),
            channels,
        )
    finally:
        for channel in channels:
            channel.close()
        stack.stop()


def _status(stub: scheduler_grpc.SchedulerServiceStub) -> scheduler_pb.GetStatusResponse:
    return stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(CALL_TIMEOUT_S))


def _drain(call) -> list[Any]:
    """Every response of a streaming call; its status is checked by the caller."""
    responses = []
    try:
        for response in call:
            responses.append(response)
    except grpc.RpcError:
        pass
    return responses


def _check(call, what: str, responses: list[Any] | None = None) -> None:
    code = call.code()
    kinds = sorted({r.WhichOneof("kind") or "" for r in responses or ()})
    OUTCOMES[(what, code.name, "+".join(kinds))] += 1
    assert code in DOCUMENTED, f"{what}: {code} {call.details()!r}"


def _acquire(servers: Servers, mode: int) -> tuple[Any, str]:
    """Hold a real lease: (the Acquire call, to cancel later; the lease id)."""
    call = servers.scheduler.Acquire(
        scheduler_pb.AcquireRequest(mode=mode, session_id="fuzz"), timeout=scaled(30)
    )
    for response in call:
        if response.WhichOneof("kind") == "lease":
            return call, response.lease.lease_id
    raise AssertionError(f"Acquire ended without a lease: {call.code()} {call.details()}")


def run_plan(servers: Servers, plan: Plan) -> None:
    """Send the plan's requests; the RPC must end with a documented status."""
    timeout = scaled(CALL_TIMEOUT_S)
    if plan.rpc == "GetStatus":
        try:
            servers.scheduler.GetStatus(plan.requests[0], timeout=timeout)
            OUTCOMES[("GetStatus", "OK", "")] += 1
        except grpc.RpcError as err:
            _check(err, "GetStatus")
    elif plan.rpc == "Acquire":
        call = servers.scheduler.Acquire(plan.requests[0], timeout=timeout)
        try:
            first = next(call)  # a queue position or a lease; then let it go
            OUTCOMES[("Acquire", "OK", first.WhichOneof("kind") or "")] += 1
        except StopIteration:
            OUTCOMES[("Acquire", "OK", "")] += 1
        except grpc.RpcError:
            _check(call, "Acquire")
        call.cancel()
    elif plan.rpc == "Register":
        call = servers.scheduler.Register(iter(plan.requests), timeout=timeout)
        _check(call, "Register", _drain(call))
    else:
        holder = None
        requests = list(plan.requests)
        if plan.real_lease:
            holder, lease_id = _acquire(servers, plan.mode)
            start = worker_pb.SessionStart()
            start.CopyFrom(requests[0])
            start.lease_id, start.mode = lease_id, plan.mode
            requests[0] = worker_pb.SessionRequest(start=start)
        call = servers.worker.Session(iter(requests), timeout=timeout)
        _check(call, "Session (real lease)" if holder else "Session", _drain(call))
        if holder is not None:
            holder.cancel()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=scaled(CALL_TIMEOUT_S))
        return reply.status


def _normal_session(servers: Servers) -> worker_pb.SessionEnded:
    """Acquire, start, three units, close: the `ended` message."""
    holder, lease_id = _acquire(servers, common_pb2.MODE_AUDIO)
    start = worker_pb.SessionStart(lease_id=lease_id, mode=common_pb2.MODE_AUDIO)
    requests = [worker_pb.SessionRequest(start=start)]
    requests += [
        worker_pb.SessionRequest(unit=worker_pb.Unit(seq=i, pcm=GOOD_PCM)) for i in (1, 2, 3)
    ]
    requests.append(
        worker_pb.SessionRequest(
            close=worker_pb.SessionClose(reason=common_pb2.CLOSE_REASON_USER_STOP)
        )
    )
    call = servers.worker.Session(iter(requests), timeout=scaled(CALL_TIMEOUT_S))
    responses = _drain(call)
    holder.cancel()
    assert call.code() == grpc.StatusCode.OK, (call.code(), call.details())
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[0] == "started" and kinds[-1] == "ended", kinds
    assert kinds.count("result") >= 1, kinds
    return responses[-1].ended


@pytest.mark.ci_long  # thousands of requests against the real servers: ~13 s
def test_servicers_answer_only_documented_statuses(servers):
    started = time.monotonic()
    fuzz = settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )(given(PLANS)(lambda plan: run_plan(servers, plan)))
    fuzz()
    took = time.monotonic() - started
    per_1k = took / EXAMPLES * 1000
    print(f"servicer fuzz: {EXAMPLES} examples in {took:.1f} s ({per_1k:.1f} s per 1k)")
    for (rpc, code, kinds), count in sorted(OUTCOMES.items()):
        print(f"  {rpc:22s} {code:20s} {kinds or '-':28s} {count}")

    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(servers.stack.scheduler_address) == serving
    assert _health(servers.worker_address) == serving
    ended = _normal_session(servers)
    assert ended.reason == common_pb2.CLOSE_REASON_USER_STOP
    # Nothing leaked: the fuzz's fake workers are gone and every lease came back.
    deadline = time.monotonic() + scaled(15)
    while True:
        status = _status(servers.scheduler)
        if (
            [w.worker_id for w in status.workers] == [WORKER_ID]
            and status.workers[0].slots_free == SLOTS
            and status.leases_active == 0
        ):
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
