"""`python -m omnifabric.worker`: the ready line once serving and registered; SIGTERM drains,
exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.errors import ConfigError
from omnifabric.worker.main import build_parser, config_from_args
from tests.conftest import ROOT, scaled


async def test_subprocess_ready_line_and_sigterm(scheduler):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "omnifabric.worker",
        "--port",
        "0",
        "--scheduler",
        scheduler.address,
        "--worker-id",
        "sub1",
        "--compute-ms",
        "1",
        "--metrics-port",
        "0",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), scaled(20))).decode()
        assert line.startswith("omnifabric worker ready: sub1 127.0.0.1:"), line
        port = int(line.split()[4].rsplit(":", 1)[1])  # the words after: metrics=...
        assert port > 0
        hello = await asyncio.wait_for(scheduler.hellos.get(), scaled(5))
        assert (hello.worker_id, hello.address) == ("sub1", f"127.0.0.1:{port}")
        assert hello.slots == 4 and hello.engine == "synthetic"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), scaled(10)) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_flags_override_env():
    env = {"OMNI_WORKER_PORT": "23000", "OMNI_WORKER_SLOTS": "2", "OMNI_WORKER_ENGINE": "synthetic"}
    args = build_parser().parse_args(["--slots", "3", "--audio-limit-s", "5"])
    os_env = dict(os.environ)
    try:
        os.environ.update(env)
        config = config_from_args(args)
    finally:
        os.environ.clear()
        os.environ.update(os_env)
    assert (config.port, config.slots, config.audio_limit_s) == (23000, 3, 5.0)


def test_env_range_errors_name_the_variable():
    with pytest.raises(ConfigError, match="OMNI_WORKER_PORT"):
        WorkerConfig.from_env({"OMNI_WORKER_PORT": "70000"})
    with pytest.raises(ConfigError, match="OMNI_WORKER_LEASE_WAIT_S"):
        WorkerConfig.from_env({"OMNI_WORKER_LEASE_WAIT_S": "abc"})
    config = WorkerConfig.from_env({"OMNI_WORKER_ID": "w7", "OMNI_WORKER_COMPUTE_MS": "0"})
    assert (config.worker_id, config.synthetic_compute_ms) == ("w7", 0.0)
    assert WorkerConfig.from_env({}).limit_s("video") == 300.0


def test_drain_fault_limit_and_tls_flags():
    args = build_parser().parse_args(
        [
            "--grace", "3", "--unit-timeout", "1.5", "--hang-unit", "2",
            "--max-message-bytes", "65536", "--fabric-tls-ca", "ca.pem",
            "--fabric-tls-cert", "node.pem", "--fabric-tls-key", "node.key",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.drain_grace_s, config.unit_timeout_s) == (3.0, 1.5)
    assert (config.synthetic_hang_unit, config.max_message_bytes) == (2, 65536)
    assert (config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key) == (
        "ca.pem",
        "node.pem",
        "node.key",
    )
    assert WorkerConfig.from_env({}).unit_timeout_s == 5.0
    with pytest.raises(ConfigError, match="OMNI_WORKER_UNIT_TIMEOUT_S"):
        WorkerConfig.from_env({"OMNI_WORKER_UNIT_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match="OMNI_FABRIC_TLS_CERT and OMNI_FABRIC_TLS_KEY"):
        WorkerConfig.from_env({"OMNI_FABRIC_TLS_KEY": "node.key"})
