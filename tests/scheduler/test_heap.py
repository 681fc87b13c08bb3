"""The scheduler's heap keeper (scheduler.heap, issue 55): passes collect the young and
freeze the survivors; the frozen heap is collected in full every thaw period; in a real
process, a young cycle is freed by a pass and a long-lived one leaves the collected
generations."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from omnifabric.scheduler.heap import HeapKeeper


class FakeGc:
    """gc's functions as the keeper calls them, and a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.calls: list[str] = []

    def keeper(self, **kwargs) -> HeapKeeper:  # type: ignore[no-untyped-def]
        return HeapKeeper(
            collect=self.collect,
            freeze=lambda: self.calls.append("freeze"),
            unfreeze=lambda: self.calls.append("unfreeze"),
            clock=lambda: self.now,
            **kwargs,
        )

    def collect(self, generation: int) -> int:
        self.calls.append(f"collect{generation}")
        return 0


def test_a_pass_collects_the_young_and_freezes_them():
    fake = FakeGc()
    keeper = fake.keeper(thaw_every_s=60.0)
    keeper.settle()
    assert fake.calls == ["collect2", "freeze"]
    fake.calls.clear()
    fake.now += 59.0
    keeper.step()
    assert fake.calls == ["collect2", "freeze"] and keeper.thaws == 0


def test_the_frozen_heap_is_collected_in_full_every_thaw_period():
    fake = FakeGc()
    keeper = fake.keeper(thaw_every_s=60.0)
    keeper.settle()
    fake.calls.clear()
    fake.now += 60.0
    keeper.step()
    assert fake.calls == ["unfreeze", "collect2", "freeze"] and keeper.thaws == 1
    fake.calls.clear()
    fake.now += 30.0
    keeper.step()  # the period counts from the last thaw
    assert fake.calls == ["collect2", "freeze"] and keeper.thaws == 1


def test_keep_steps_until_cancelled_and_leaves_nothing_frozen():
    fake = FakeGc()

    async def run() -> None:
        keeper = fake.keeper(period_s=0.01)
        task = asyncio.ensure_future(keeper.keep())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert keeper.passes >= 3

    asyncio.run(run())
    assert fake.calls[-1] == "unfreeze"


def test_in_a_real_process_cycles_are_freed_and_survivors_frozen():
    code = textwrap.dedent(
        """
        import gc
        from omnifabric.scheduler.heap import HeapKeeper

        class Node:
            pass

        keeper = HeapKeeper()
        keeper.settle()
        base = gc.get_freeze_count()
        kept = [Node() for _ in range(1000)]
        for node in kept:
            node.me = node  # alive, and a cycle: frozen by the next pass
        young = Node()
        young.me = young
        del young  # garbage: the pass collects it, not freezes it
        keeper.step()
        assert gc.get_freeze_count() >= base + 1000, (base, gc.get_freeze_count())
        assert all(gc.is_tracked(n) for n in kept)
        assert sum(len(gc.get_objects(g)) for g in range(3)) < 1000
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr
