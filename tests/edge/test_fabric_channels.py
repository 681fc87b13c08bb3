"""The edge's worker channels: a lost worker's channel is forgotten, the next session dials
anew, and closing the fabric closes the forgotten channel too."""

from __future__ import annotations

from omnifabric.edge.fabric import Fabric


async def test_a_forgotten_worker_is_dialled_anew_and_its_old_channel_closed():
    fabric = Fabric("127.0.0.1:1", 1 << 20)
    first = fabric.worker("127.0.0.1:2")
    assert fabric.worker("127.0.0.1:2") is first  # cached while the worker is known
    old_channel = fabric._workers["127.0.0.1:2"][0]
    fabric.forget_worker("127.0.0.1:2")
    fabric.forget_worker("127.0.0.1:3")  # never dialled: nothing to forget
    second = fabric.worker("127.0.0.1:2")
    assert second is not first
    assert fabric._workers["127.0.0.1:2"][0] is not old_channel
    assert len(fabric._closing) == 1  # the old channel's delayed close is pending
    assert not old_channel._channel.closed()  # calls still on it may finish
    await fabric.close()
    # The forgotten channel was closed with the rest, not left to its linger timer.
    assert old_channel._channel.closed()
    assert fabric._retired == set() and fabric._workers == {}
    assert all(task.cancelled() or task.cancelling() for task in fabric._closing)


async def test_a_start_retried_waits_for_the_workers_connection_a_little():
    """redial_worker: a fresh channel, then up to its timeout for the connection: made at
    once where the worker listens (here it starts listening after the first connect fails,
    as a link that comes back), not made where nothing does."""
    import asyncio
    import time

    import grpc

    from tests.redis_server import free_port

    port = free_port()
    fabric = Fabric("127.0.0.1:1", 1 << 20)
    server = grpc.aio.server()
    try:
        t0 = time.monotonic()
        assert not await fabric.redial_worker(f"127.0.0.1:{port}", timeout_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 2.0
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        assert await fabric.redial_worker(f"127.0.0.1:{port}", timeout_s=5.0)
        assert fabric._workers[f"127.0.0.1:{port}"][0].get_state() == grpc.ChannelConnectivity.READY
    finally:
        await server.stop(None)
        await fabric.close()
        await asyncio.sleep(0)
