"""The Redis elector against a real redis-server: acquire with an epoch, renew, release,
step down on another holder and when the store is gone (after the TTL, not before)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from omnifabric.scheduler.election import (
    LEADER_KEY,
    RedisElector,
    StoreUrlError,
    Term,
    parse_store_url,
)
from tests.conftest import scaled
from tests.redis_server import RedisServer, redis_server  # noqa: F401 - fixture

TTL_S = 0.9


def test_parse_store_url_forms() -> None:
    plain = parse_store_url("redis://127.0.0.1:6380/2")
    assert plain.hosts == (("127.0.0.1", 6380),) and plain.db == 2 and not plain.sentinel
    assert parse_store_url("redis://h").hosts == (("h", 6379),)
    secret = parse_store_url("redis://:p%40ss@h:1/0")
    assert secret.password == "p@ss" and "p@ss" not in secret.describe()
    sentinel = parse_store_url("redis+sentinel://a:26379,b:26380/mymaster/1")
    assert sentinel.sentinel and sentinel.service == "mymaster" and sentinel.db == 1
    assert sentinel.hosts == (("a", 26379), ("b", 26380))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://h:1/0", "must start with"),
        ("redis://:1/0", "empty host"),
        ("redis://h:70000/0", "port must be"),
        ("redis://h:1/zero", "database must be a number"),
        ("redis://a:1,b:2/0", "several hosts"),
        ("redis+sentinel://a:1", "names the service"),
        ("redis://h:1/0/x", "past the database"),
    ],
)
def test_parse_store_url_names_the_fault(url: str, words: str) -> None:
    with pytest.raises(StoreUrlError, match=words):
        parse_store_url(url)


def elector(server: RedisServer, name: str, ttl_s: float = TTL_S) -> RedisElector:
    return RedisElector(parse_store_url(server.url), name, ttl_s)


async def wait_for(predicate, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `predicate()` held; AssertionError past the (scaled) timeout."""
    start = time.monotonic()
    deadline = start + scaled(timeout_s)
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_one_leads_and_a_release_hands_over(redis_server: RedisServer) -> None:  # noqa: F811
    a, b = elector(redis_server, "a"), elector(redis_server, "b")
    changes: list[tuple[str, bool, int]] = []
    for e in (a, b):
        e.listeners.append(lambda leading, term, e=e: changes.append((e.holder, leading, e.epoch)))
    await a.start()
    await wait_for(lambda: a.leading, 2)
    await b.start()
    await asyncio.sleep(TTL_S * 2)  # renewals keep a; b stays standby
    assert a.leading and not b.leading and a.epoch == 1
    assert b.seen == Term(1, "a")
    await a.stop()
    took = await wait_for(lambda: b.leading, 2)
    assert took < scaled(0.5), took  # released: taken at the next poll, not after the TTL
    assert b.epoch == 2
    # b was told of a's term as a standby, then of its own.
    assert changes == [("a", True, 1), ("b", False, 0), ("a", False, 1), ("b", True, 2)]
    await b.stop()


async def test_steps_down_at_once_when_another_holds_the_key(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    from redis import asyncio as redis_asyncio

    a = elector(redis_server, "a")
    await a.start()
    await wait_for(lambda: a.leading, 2)
    client = redis_asyncio.Redis(port=redis_server.port)
    await client.set(LEADER_KEY, "7 intruder", px=int(TTL_S * 10_000))
    took = await wait_for(lambda: not a.leading, 2)
    assert took < scaled(TTL_S / 3 + 0.2), took  # at the next renew
    assert a.seen == Term(7, "intruder")
    await a.stop()
    # Stopping does not delete a key that is not ours.
    assert await client.get(LEADER_KEY) == b"7 intruder"
    await client.aclose()


async def test_store_gone_leads_until_the_ttl_only(redis_server: RedisServer) -> None:  # noqa: F811
    a = elector(redis_server, "a")
    await a.start()
    await wait_for(lambda: a.leading, 2)
    # Just renewed: the key has close to a full TTL left.
    renewed = a._valid_until
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        took = await wait_for(lambda: not a.leading, 3)
        assert time.monotonic() >= renewed - 0.01
        # It kept leading while the key could still be alive in the store, and no longer.
        assert took <= TTL_S + scaled(0.1), took
        assert stopped + took >= renewed - 0.01
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    # The store back: it leads again, with a new epoch once its old key expired.
    await wait_for(lambda: a.leading, 4)
    assert a.epoch >= 1
    await a.stop()


async def test_epochs_only_grow(redis_server: RedisServer) -> None:  # noqa: F811
    epochs = []
    for name in ("a", "b", "c"):
        e = elector(redis_server, name)
        await e.start()
        await wait_for(lambda e=e: e.leading, 2)
        epochs.append(e.epoch)
        await e.stop()
    assert epochs == [1, 2, 3]


async def test_unreachable_store_at_start_is_retried(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.redis_server import free_port, start_redis

    port = free_port()
    a = RedisElector(parse_store_url(f"redis://127.0.0.1:{port}/0"), "a", TTL_S)
    await a.start()
    await asyncio.sleep(0.3)
    assert not a.leading
    server = start_redis(tmp_path, port)
    try:
        await wait_for(lambda: a.leading, 3)
    finally:
        await a.stop()
        server.stop()


async def test_a_real_sentinel_names_the_master_the_electors_use(
    redis_server: RedisServer,  # noqa: F811
    tmp_path,
) -> None:
    """redis+sentinel://: the electors ask a real Sentinel for the master and hold the
    leader key there (one leads, the other takes over on release)."""
    from redis import asyncio as redis_asyncio

    from omnifabric.scheduler.election import check_store
    from omnifabric.tools.redis_local import start_sentinel

    sentinel = start_sentinel(tmp_path, redis_server.port)
    try:
        address = parse_store_url(f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster/0")
        await check_store(address)
        a, b = (RedisElector(address, name, TTL_S) for name in ("a", "b"))
        await a.start()
        await wait_for(lambda: a.leading, 5)
        await b.start()
        client = redis_asyncio.Redis(port=redis_server.port)
        assert (await client.get(LEADER_KEY)).decode().endswith(" a")  # on the master
        await a.stop()
        await wait_for(lambda: b.leading, 5)
        assert b.epoch == a.epoch + 1
        await b.stop()
        await client.aclose()
        # A service the sentinels do not know is named in the error.
        with pytest.raises(Exception, match="nomaster"):
            await check_store(
                parse_store_url(f"redis+sentinel://127.0.0.1:{sentinel.port}/nomaster/0")
            )
    finally:
        sentinel.stop()


async def test_epochs_keep_growing_when_the_store_loses_its_counter(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """A Redis restarted without persistence comes back empty: the next leadership still gets
    a higher epoch than any a candidate has seen (workers refuse lower ones)."""
    from redis import asyncio as redis_asyncio

    a, b = elector(redis_server, "a"), elector(redis_server, "b")
    await a.start()
    await wait_for(lambda: a.leading, 2)
    await b.start()
    await wait_for(lambda: b.seen is not None, 2)
    client = redis_asyncio.Redis(port=redis_server.port)
    await client.flushall()  # the counter and the key gone
    await client.aclose()
    await wait_for(lambda: (a.leading or b.leading) and max(a.epoch, b.epoch) > 1, 5)
    assert max(a.epoch, b.epoch) == 2
    for e in (a, b):
        await e.stop()
