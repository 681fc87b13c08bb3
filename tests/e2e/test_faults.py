"""Faults, drains and TLS of the gRPC fabric across real processes (RELIABILITY.md F3, F4,
F5, G5): each test prints the figures it measured (pytest -s shows them)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.exceptions import ConnectionClosed

from omnifabric.common.close_reasons import INFERENCE_ERROR, SERVER_SHUTDOWN, close_message
from omnifabric.edge.fabric import FIRST_REPLY_TIMEOUT_S
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from tests.conftest import ROOT, scaled
from tests.e2e.wsclient import SILENCE, WsClient, metric, scrape_metrics, served_unit, wait_for
from tests.stack import read_until_line, start_service


async def status(address: str, credentials=None) -> scheduler_pb.GetStatusResponse:
    channel = (
        grpc.aio.secure_channel(address, credentials)
        if credentials
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        return await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))


def worker_of(snapshot: scheduler_pb.GetStatusResponse, worker_id: str):
    return next((w for w in snapshot.workers if w.worker_id == worker_id), None)


async def started(url: str) -> WsClient:
    client = await WsClient.open(url)
    await client.start()
    return client


async def refused(url: str) -> dict:
    """Open a client that must be refused: its error event; the close code is 1013."""
    client = await WsClient.open(url)
    err = await client.until("error", "session.queued", "session.queue_done")
    assert err["type"] == "error", err
    with pytest.raises(ConnectionClosed) as info:
        await client.until("never")
    assert info.value.rcvd.code == 1013
    return err


async def test_scheduler_killed_sessions_go_on_and_restart_reregisters(stack):
    """F4: SIGKILL the scheduler mid-session. The session goes on with its worker; new
    sessions get service_unavailable at once; a scheduler restarted on the same port gets
    the worker back with its running lease, so a new client is queued behind it (never
    a second lease on the busy slot) and served once the survivor leaves."""
    scheduler = stack.start_scheduler()
    stack.start_worker("--slots", "1", "--compute-ms", "5", name="w0")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    survivor = await WsClient.open(url)
    await survivor.start()
    await served_unit(survivor)
    [lease_id] = worker_of(await status(stack.scheduler_address), "w0").lease_ids

    scheduler.kill(signal.SIGKILL)
    scheduler.proc.wait(scaled(5))
    await served_unit(survivor)
    t0 = time.monotonic()
    err = await refused(url)
    refused_s = time.monotonic() - t0
    assert err["error"]["code"] == "service_unavailable"
    assert "127.0.0.1" not in err["error"]["message"]  # no transport internals
    assert refused_s < scaled(1.0)
    await served_unit(survivor)

    stack.restart_scheduler()
    ready = time.monotonic()

    async def accepted() -> WsClient | None:
        client = await WsClient.open(url)
        first = await client.until("error", "session.queued", "session.queue_done")
        if first["type"] == "error":
            assert first["error"]["code"] == "service_unavailable", first
            return None
        return client

    waiting = None
    while waiting is None:
        assert time.monotonic() - ready < scaled(10), "no session accepted after the restart"
        waiting = await accepted()
        if waiting is None:
            await asyncio.sleep(0.05)
    new_session_s = time.monotonic() - ready
    # The busy 1-slot worker is not leased twice: the new client waits.
    assert waiting.events[-1]["type"] == "session.queued"
    assert waiting.events[-1]["position"] == 1

    async def reregistered() -> bool:
        w = worker_of(await status(stack.scheduler_address), "w0")
        return w is not None and list(w.lease_ids) == [lease_id] and w.slots_free == 0

    await wait_for(reregistered, 10)
    rereg = await status(stack.scheduler_address)
    assert rereg.leases_active == 0 and rereg.queue_length == 1  # the survivor's is an orphan

    await served_unit(survivor)
    await survivor.send({"type": "session.close"})
    closed = await survivor.until("session.closed")
    assert closed["reason"] == "user_stop"
    t_free = time.monotonic()
    await waiting.until("session.queue_done")
    handover_s = time.monotonic() - t_free
    await waiting.send({"type": "session.init", "payload": {"system_prompt": "hi"}})
    await waiting.until("session.created")
    await served_unit(waiting)
    assert not [e for e in survivor.events if e["type"] == "error"]
    assert sum(e["type"] == "session.closed" for e in survivor.events) == 1
    print(
        f"F4: refused while down in {refused_s * 1000:.0f} ms; after the restart a new "
        f"session was accepted in {new_session_s:.2f} s; the freed slot went to the "
        f"queued client in {handover_s * 1000:.0f} ms"
    )


@pytest.mark.ci_long  # waits out the first reply's timeout: ~7 s (tests/conftest.py)
async def test_hung_scheduler_refuses_new_sessions_within_the_first_reply_timeout(stack):
    """A scheduler that is alive but does not answer (SIGSTOP): its TCP connection stays
    up, so only the edge's first-reply timeout (FIRST_REPLY_TIMEOUT_S, 5 s) ends a new
    client's wait, with service_unavailable; the running session goes on meanwhile."""
    scheduler = stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5", name="w0")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    running = await started(url)
    scheduler.kill(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        client = await WsClient.open(url)
        err = await client.until("error", "session.queued", timeout_s=FIRST_REPLY_TIMEOUT_S + 2)
        took = time.monotonic() - t0
        assert err["type"] == "error" and err["error"]["code"] == "service_unavailable"
        assert FIRST_REPLY_TIMEOUT_S - 0.5 < took < scaled(FIRST_REPLY_TIMEOUT_S + 1.5)
        await served_unit(running)
    finally:
        scheduler.kill(signal.SIGCONT)
    print(f"hung scheduler: new client refused after {took:.2f} s")


@pytest.mark.ci_long  # a scheduler restarted and its workers back: ~6 s (tests/conftest.py)
async def test_worker_reregistration_time_after_scheduler_restart(stack):
    """F4 figure: the time from a restarted scheduler's ready line until the worker is
    registered again, after an outage long enough for its retry backoff (0.2 s doubling)
    to reach its 2 s cap: the worst case."""
    scheduler = stack.start_scheduler()
    worker = stack.start_worker("--slots", "1", "--compute-ms", "5", name="w0")
    scheduler.kill(signal.SIGKILL)
    scheduler.proc.wait(scaled(5))
    down = time.monotonic()

    async def backoff_capped() -> bool:  # 0.2 + 0.4 + 0.8 + 1.6 s of failed attempts
        return worker.log().count("registration with") >= 5

    await wait_for(backoff_capped, 10, interval_s=0.1)
    stack.restart_scheduler()
    outage_s = time.monotonic() - down

    async def registered() -> bool:
        return worker_of(await status(stack.scheduler_address), "w0") is not None

    took = await wait_for(registered, 10)
    print(
        f"F4: after a {outage_s:.1f} s outage the worker registered again {took:.2f} s "
        "after the scheduler's ready line"
    )
    assert took < scaled(2.5)  # one backoff step at most (OMNI_WORKER_REGISTER_BACKOFF_MAX_S)


async def test_worker_drain(stack):
    """F3/G5: SIGTERM a worker. Its health turns NOT_SERVING and the scheduler stops leasing
    it within 1 s; its sessions end in-band with server_shutdown (a unit in progress is
    answered first); the other worker's session goes on and takes the next client; the
    drained worker exits 0."""
    stack.start_scheduler()
    # wa: 1 s units, so its drain lasts while a unit is in progress.
    wa = stack.start_worker("--slots", "3", "--compute-ms", "1000", "--grace", "5", name="wa")
    stack.start_worker("--slots", "2", "--compute-ms", "5", name="wb")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    # One at a time: the scheduler leases the worker with the most free slots (ties: the
    # older), so the first two land on wa and the third on wb.
    idle, busy, other = [await started(url) for _ in range(3)]
    snapshot = await status(stack.scheduler_address)
    assert len(worker_of(snapshot, "wa").lease_ids) == 2
    assert len(worker_of(snapshot, "wb").lease_ids) == 1
    wa_address = worker_of(snapshot, "wa").address

    edge_address = stack.url.split("://", 1)[1].split("/", 1)[0]

    async def forwarded() -> bool:
        samples = await asyncio.to_thread(scrape_metrics, edge_address)
        return metric(samples, "omni_edge_units_forwarded_total") == 1

    await busy.append(SILENCE)
    # The unit is in the engine now: the edge has sent it to wa (the only unit of the
    # test so far: polled, however long the client's and the edge's part takes), and wa's
    # own part, its receipt and the engine's start (~1 ms; no metric shows a unit before
    # its answer), gets 0.5 s, half of the unit's 1 s of compute.
    await wait_for(forwarded, 5, interval_s=0.01)
    await asyncio.sleep(0.5)
    wa.kill(signal.SIGTERM)
    t0 = time.monotonic()

    async def not_leasable() -> bool:
        w = worker_of(await status(stack.scheduler_address), "wa")
        return w is None or w.health != common_pb2.WORKER_HEALTH_SERVING

    g5_s = await wait_for(not_leasable, 1.0, interval_s=0.01)
    async with grpc.aio.insecure_channel(wa_address) as channel:
        check = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="omni.realtime.v1.WorkerService"),
            timeout=scaled(2),
        )
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING

    # A client arriving during the drain goes to wb.
    newcomer = await WsClient.open(url)
    await newcomer.start()
    assert len(worker_of(await status(stack.scheduler_address), "wb").lease_ids) == 2

    async def closed_after(client: WsClient) -> tuple[dict, float]:
        event = await client.until("session.closed", timeout_s=6)
        return event, time.monotonic() - t0

    (idle_closed, idle_s), (busy_closed, busy_s) = await asyncio.gather(
        closed_after(idle), closed_after(busy)
    )
    assert idle_closed["reason"] == busy_closed["reason"] == "server_shutdown"
    assert idle_closed["message"] == busy_closed["message"] == close_message(SERVER_SHUTDOWN)
    # The unit in progress was answered before the close: nothing lost.
    kinds = [e["type"] for e in busy.events]
    assert "response.output.delta" in kinds
    assert kinds.index("response.output.delta") < kinds.index("session.closed")
    for client in (idle, busy):
        assert not [e for e in client.events if e["type"] == "error"]
    assert wa.proc.wait(scaled(10)) == 0
    await served_unit(other)
    await served_unit(newcomer)
    print(
        f"F3/G5: scheduler stopped leasing the draining worker {g5_s * 1000:.0f} ms after "
        f"SIGTERM; idle session closed (server_shutdown) after {idle_s * 1000:.0f} ms, the "
        f"one with a 1 s unit in progress after {busy_s * 1000:.0f} ms"
    )
    assert g5_s < 1.0


async def test_scheduler_drain(stack):
    """SIGTERM to the scheduler: the queued client is told (service_unavailable, 1013) at
    once, the running session goes on with its worker (no lease revoked), the scheduler
    exits 0 within its grace, and a restarted one gets the worker and its lease back."""
    scheduler = stack.start_scheduler("--grace", "2")
    worker = stack.start_worker("--slots", "1", "--compute-ms", "5", name="w0")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    running = await WsClient.open(url)
    await running.start()
    await served_unit(running)
    queued = await WsClient.open(url)
    await queued.until("session.queued")
    [lease_id] = worker_of(await status(stack.scheduler_address), "w0").lease_ids

    scheduler.kill(signal.SIGTERM)
    t0 = time.monotonic()
    err = await queued.until("error", timeout_s=2)
    told_s = time.monotonic() - t0
    assert err["error"] == {
        "code": "service_unavailable",
        "message": "scheduler is shutting down",
        "type": "server_error",
    }
    with pytest.raises(ConnectionClosed) as info:
        await queued.until("never")
    assert info.value.rcvd.code == 1013
    assert scheduler.proc.wait(scaled(2 + 3)) == 0
    exit_s = time.monotonic() - t0
    await served_unit(running)
    assert (await refused(url))["error"]["code"] == "service_unavailable"
    assert "revoked" not in worker.log()

    stack.restart_scheduler()

    async def back_with_lease() -> bool:
        w = worker_of(await status(stack.scheduler_address), "w0")
        return w is not None and list(w.lease_ids) == [lease_id]

    await wait_for(back_with_lease, 10)
    await served_unit(running)
    await running.send({"type": "session.close"})
    await running.until("session.closed")

    async def slot_free() -> bool:
        w = worker_of(await status(stack.scheduler_address), "w0")
        return w is not None and w.slots_free == 1 and not w.lease_ids

    await wait_for(slot_free, 2)
    print(
        f"scheduler drain: queued client told in {told_s * 1000:.0f} ms, "
        f"scheduler exited after {exit_s * 1000:.0f} ms"
    )


async def test_hung_engine_call_ends_the_session_and_takes_the_worker_out(stack):
    """F5 (hang): the engine does not come back from unit 2. The worker's watchdog ends
    that session with error/inference_error after --unit-timeout, releases the lease and
    reports NOT_SERVING (the stuck thread cannot be killed), so nobody is leased onto it;
    on SIGTERM it still exits at once."""
    stack.start_scheduler()
    worker = stack.start_worker(
        "--slots", "2", "--compute-ms", "5", "--hang-unit", "2", "--unit-timeout", "1",
        name="hw",
    )  # fmt: skip
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    client = await WsClient.open(url)
    await client.start()
    await served_unit(client)
    await client.append(SILENCE)
    t0 = time.monotonic()
    err = await client.until("error", timeout_s=3)
    closed = await client.until("session.closed")
    took = time.monotonic() - t0
    assert err["error"]["code"] == "inference_error"
    assert err["error"]["message"] == close_message(
        INFERENCE_ERROR, "the engine did not finish unit 2 within 1 s"
    )
    assert closed["reason"] == "error"
    assert took < 2.5  # the worker's 1 s watchdog, before the edge's 3 s one

    async def out_of_rotation() -> bool:
        w = worker_of(await status(stack.scheduler_address), "hw")
        return w.health == common_pb2.WORKER_HEALTH_NOT_SERVING and not w.lease_ids

    await wait_for(out_of_rotation, 2)
    w = worker_of(await status(stack.scheduler_address), "hw")
    assert w.detail.startswith("engine stuck: unit 2 of session ")
    waiting = await WsClient.open(url)
    assert (await waiting.until("session.queued", "session.queue_done"))["type"] == (
        "session.queued"
    )
    await waiting.close()
    t1 = time.monotonic()
    assert worker.stop(timeout_s=5) == 0
    print(
        f"F5: hung unit closed with inference_error after {took * 1000:.0f} ms; "
        f"the stuck worker exited {time.monotonic() - t1:.2f} s after SIGTERM"
    )


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A self-signed CA and one certificate for 127.0.0.1 (IP SAN, server and client use),
    made with the openssl CLI; plus a second CA that signed nothing here."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-subj", f"/CN=omnifabric test {ca}",
            cwd=d,
        )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
        "-subj", "/CN=127.0.0.1", cwd=d,
    )  # fmt: skip
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
    )
    _openssl(
        "x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", "node.pem", "-extfile", "ext.cnf", cwd=d,
    )  # fmt: skip
    return d


async def test_tls_between_services(stack, pki):
    """mTLS on every fabric hop: scheduler and worker serve with cert+key+CA (client
    certificates required), the worker and the edge dial with the CA and present the same
    certificate; one session end to end. A plaintext worker cannot register, and neither
    can one that trusts another CA: the log says why."""
    tls = [
        "--fabric-tls-ca", str(pki / "ca.pem"),
        "--fabric-tls-cert", str(pki / "node.pem"),
        "--fabric-tls-key", str(pki / "node.key"),
    ]  # fmt: skip
    stack.start_scheduler(*tls)
    stack.start_worker("--slots", "1", "--compute-ms", "5", *tls, name="tw")
    stack.start_edge(*tls)
    client = await WsClient.open(f"{stack.url}?mode=audio")
    await client.start()
    await served_unit(client)
    await client.send({"type": "session.close"})
    assert (await client.until("session.closed"))["reason"] == "user_stop"

    # The services refuse plaintext.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await status(stack.scheduler_address)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "node.key").read_bytes(),
        certificate_chain=(pki / "node.pem").read_bytes(),
    )
    snapshot = await status(stack.scheduler_address, credentials)
    assert [w.worker_id for w in snapshot.workers] == ["tw"]

    common = ["--port", "0", "--metrics-port", "0", "--scheduler", stack.scheduler_address]
    wrong_ca = [
        "--fabric-tls-ca", str(pki / "other-ca.pem"),
        "--fabric-tls-cert", str(pki / "node.pem"),
        "--fabric-tls-key", str(pki / "node.key"),
    ]  # fmt: skip
    outsiders = [
        start_service("plain", "omnifabric.worker", [*common, "--worker-id", "plain"],
                      stack.log_dir),
        start_service("wrongca", "omnifabric.worker",
                      [*common, "--worker-id", "wrongca", *wrong_ca], stack.log_dir),
    ]  # fmt: skip
    stack.services.extend(outsiders)
    plain, wrongca = outsiders

    async def both_logged() -> bool:
        return "registration with" in plain.log() and "registration with" in wrongca.log()

    await wait_for(both_logged, 15, interval_s=0.1)
    assert "plaintext channel: a scheduler that speaks TLS refuses it" in plain.log()
    assert "CERTIFICATE_VERIFY_FAILED" in wrongca.log()
    snapshot = await status(stack.scheduler_address, credentials)
    assert [w.worker_id for w in snapshot.workers] == ["tw"]
    assert "omnifabric worker ready" not in plain.log() + wrongca.log()


def test_serve_drains_edge_then_workers_then_scheduler(tmp_path):
    """`omnifabric serve --grace 3` passes its grace to every child and, on SIGTERM,
    drains the edge first (the client gets session.closed{server_shutdown}), then both
    workers, then the scheduler; every child exits 0 and so does serve."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    serve = subprocess.Popen(
        [
            sys.executable, "-m", "omnifabric.tools.cli", "serve", "--engine", "synthetic",
            "--workers", "2", "--port", "0", "--grpc-port", "0", "--scheduler-port", "0",
            "--worker-base-port", "0", "--grace", "3",
        ],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        url = read_until_line(serve, "omnifabric ready: ").split()[-1]
        children = subprocess.run(
            ["ps", "-ww", "-o", "args=", "--ppid", str(serve.pid)], capture_output=True, text=True
        ).stdout.splitlines()
        assert len(children) == 4 and all("--grace 3.0" in args for args in children), children

        async def session_then_sigterm() -> dict:
            client = await WsClient.open(f"{url}?mode=audio")
            await client.start()
            await served_unit(client)
            serve.send_signal(signal.SIGTERM)
            return await client.until("session.closed", timeout_s=5)

        closed = asyncio.run(session_then_sigterm())
        assert closed["reason"] == "server_shutdown"
        rest, _ = serve.communicate(timeout=scaled(30))
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 0, rest
    steps = [line for line in rest.splitlines() if line.startswith("omnifabric serve: ")]
    assert steps == [
        "omnifabric serve: draining edge (grace 3 s)",
        "omnifabric serve: edge exited (0)",
        "omnifabric serve: draining worker0, worker1 (grace 3 s)",
        "omnifabric serve: worker0 exited (0)",
        "omnifabric serve: worker1 exited (0)",
        "omnifabric serve: draining scheduler (grace 3 s)",
        "omnifabric serve: scheduler exited (0)",
    ], rest
    assert rest.rstrip().endswith("omnifabric stopped")
