"""Where the gRPC servers listen (common.listen): IPv6 literals, ports in use, dialable hosts."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omnifabric.common import listen
from tests.conftest import needs_ipv6


def test_targets_bracket_ipv6_literals_and_dial_hosts_replace_wildcards():
    assert listen.target("127.0.0.1", 50051) == "127.0.0.1:50051"
    assert listen.target("::1", 0) == "[::1]:0"
    assert listen.target("[::1]", 7) == "[::1]:7"
    assert listen.target("localhost", 7) == "localhost:7"
    assert listen.dial_host("0.0.0.0") == "127.0.0.1"
    assert listen.dial_host("::") == listen.dial_host("[::]") == "[::1]"
    assert listen.dial_host("") == "127.0.0.1"
    assert listen.dial_host("fd00::2") == "[fd00::2]"
    assert listen.dial_host("10.1.2.3") == "10.1.2.3"


def test_a_port_in_use_is_an_oserror_that_names_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        with pytest.raises(
            OSError, match=rf"cannot listen on 127\.0\.0\.1:{port}: the port is in use"
        ):
            listen.add_port(server, "127.0.0.1", port)
        server.stop(None)


@needs_ipv6
def test_a_server_on_an_ipv6_literal_is_bound_and_answers():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = listen.add_port(server, "::1", 0)  # "::1:0" alone is no address to gRPC
    assert port > 0
    server.start()
    try:
        with grpc.insecure_channel(listen.target(listen.dial_host("::1"), port)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)


def test_a_metrics_port_in_use_is_an_oserror_that_names_the_address():
    from prometheus_client import CollectorRegistry

    from omnifabric.common.metrics import serve_http

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "):
            serve_http(CollectorRegistry(), "127.0.0.1", port)


def test_dial_addresses_are_checked_before_anything_dials_them():
    assert listen.check_address("sched-host:50051") == "sched-host:50051"
    assert listen.check_address("[fd00::1]:50051") == "[fd00::1]:50051"
    for bad, why in [
        ("sched-host", "is not host:port"),
        ("sched-host:http", "is not host:port"),
        ("sched-host:0", "out of range"),
        ("sched-host:70000", "out of range"),
        ("::1:50051", r"put an IPv6 address in brackets, e\.g\. \[::1\]:50051"),
    ]:
        with pytest.raises(ValueError, match=why):
            listen.check_address(bad)


def test_a_worker_is_told_at_start_about_an_address_it_could_not_be_dialled_at():
    from omnifabric.common.config import ConfigError
    from omnifabric.worker.config import WorkerConfig

    with pytest.raises(ConfigError, match="OMNI_WORKER_ADVERTISE.*brackets"):
        WorkerConfig(advertise_address="fd00::2:22400")
    with pytest.raises(ConfigError, match="OMNI_WORKER_SCHEDULER.*brackets"):
        WorkerConfig(scheduler_address="127.0.0.1:50051,::1:50052")
    assert WorkerConfig(advertise_address="[fd00::2]:22400").advertise_address
