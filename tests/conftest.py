"""Shared test settings: one time factor for every timeout (OMNI_TEST_TIME_FACTOR)."""

from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the tests package itself


def _installed_tree() -> Path | None:
    """The source tree the installed omnifabric.* packages come from (None: not installed).
    The tests, and the services they start as processes, import omnifabric from the
    environment, so it has to be this tree's editable install."""
    import importlib.util

    spec = importlib.util.find_spec("omnifabric.edge")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent.parent


if _installed_tree() != ROOT:
    raise SystemExit(
        f"omnifabric is installed from {_installed_tree()}, not from {ROOT}: "
        f"run `pip install -e {ROOT}` in this environment (bash tools/dev test does)"
    )

from omnifabric.common import grpc_io  # noqa: E402 - after the check above

# The suite's own gRPC clients and servers run on the I/O layer the services use.
grpc_io.choose()


#: Multiply every timeout in the tests by this (slow or loaded CI machines).
TIME_FACTOR = float(os.environ.get("OMNI_TEST_TIME_FACTOR", "1"))


def scaled(seconds: float) -> float:
    """A timeout in seconds, scaled by OMNI_TEST_TIME_FACTOR."""
    return seconds * TIME_FACTOR


def _binds_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


#: Skips a test that listens on ::1 where the host has no IPv6 loopback.
needs_ipv6 = pytest.mark.skipif(not _binds_ipv6_loopback(), reason="no IPv6 loopback here")


def claimed_png(width: int, height: int) -> bytes:
    """A PNG file whose header claims ``width`` x ``height`` grey pixels and holds none: an
    image parser opens it without decoding, as it would a decompression bomb."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


#: Long runs (a soak, the whole bench, load through every tool) are opt-in, to keep the
#: default suite within ~10 minutes on a 2-core machine: `bash tools/dev test -m long` runs
#: them alone, OMNI_LONG_TESTS=1 with the rest.
LONG = "long"
#: The default suite's own long tests (callers speaking in real time for half a minute, an
#: hour of units, a bench run, a long conversation through the real models): left out of
#: the README's `bash tools/dev test` for the same 10 minutes, and run by CI in a second
#: call after it (.ci/run: `bash tools/dev test -m ci_long`), so CI runs every test.
CI_LONG = "ci_long"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{LONG}: a long run, opt-in (bash tools/dev test -m {LONG}; OMNI_LONG_TESTS=1)"
    )
    config.addinivalue_line(
        "markers",
        f"{CI_LONG}: a long test CI runs after the default suite, which leaves it out "
        f"(bash tools/dev test -m {CI_LONG}; OMNI_LONG_TESTS=1 runs it with the rest)",
    )


_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Say which long tests the run left out and how to run them."""
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} {CI_LONG} test{'s' * (left_out != 1)} left out (CI runs them): "
            f"bash tools/dev test -m {CI_LONG}"
        )


def _named(config: pytest.Config, marker: str) -> bool:
    """Whether -m names `marker` as a word (`-m ci_long` does not name `long`)."""
    return re.search(rf"\b{marker}\b", config.option.markexpr or "") is not None


def _asked_for(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether the command line names this test itself (path::name), not only its file."""
    for arg in config.args:
        path, sep, name = arg.partition("::")
        if not sep:
            continue
        try:
            node = f"{Path(path).resolve().relative_to(config.rootpath).as_posix()}::{name}"
        except ValueError:  # outside the repository
            continue
        if item.nodeid == node or item.nodeid.startswith((f"{node}[", f"{node}::")):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    everything = os.environ.get("OMNI_LONG_TESTS") == "1"
    if not (everything or _named(config, CI_LONG)):
        left_out = [i for i in items if CI_LONG in i.keywords and not _asked_for(config, i)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            dropped = set(map(id, left_out))
            items[:] = [i for i in items if id(i) not in dropped]
            config.stash[_LEFT_OUT] = len(left_out)
    if everything or _named(config, LONG):
        return
    skip = pytest.mark.skip(reason=f"a long run, opt-in: bash tools/dev test -m {LONG}")
    for item in items:
        if LONG in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: object) -> None:
    """Collecting the suite imports torch, transformers and every module: ~450k objects,
    which a full collection of this process then walks in ~220 ms, a stall of whatever a
    timing test is measuring at that moment (E7's connect p99 read 262 ms in a full run,
    1-5 ms alone). Frozen, they are never walked again, as the services do at startup."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def reference_fabric(tmp_path_factory):
    """A scheduler and one reference worker (2 slots, `worker0`) for the whole run: the
    browser tests and tests/e2e/test_reference.py each start their own edge on it
    (tests.stack.edge_on), so its models load and warm up once, not once per file."""
    from tests.stack import start_reference_fabric

    s = start_reference_fabric(tmp_path_factory.mktemp("reference-fabric"))
    yield s
    s.stop()


@pytest.fixture
def stack(tmp_path):
    """An empty local stack (tests.stack.Stack) the test starts services in, stopped after
    it; a module that needs another kind defines its own `stack`."""
    from tests.stack import Stack

    s = Stack(tmp_path)
    yield s
    s.stop()
