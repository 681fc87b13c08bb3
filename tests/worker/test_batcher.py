"""Batched steps (worker.batcher) on the synthetic engine's batched entry, without gRPC:
every session gets per unit what it gets alone, steps hold several sessions, a row's
failure stays its own, a stuck step fails the sessions in it, and the headroom charges each
unit its share of its step."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omnifabric.worker.batcher import StepBatcher
from omnifabric.worker.engine import DuplexSettings
from omnifabric.worker.engines.synthetic import SyntheticEngine
from omnifabric.worker.metrics import WorkerMetrics
from omnifabric.worker.session import DuplexSession
from omnifabric.worker.session_types import CloseReason, SessionEnd, SessionLimits, SessionSpec
from omnifabric.worker.units import UnitInput
from tests.conftest import scaled

SPEECH = (0.1 * np.sin(np.arange(16000) / 5.0)).astype(np.float32)
SILENCE = np.zeros(16000, np.float32)


def script(n: int, offset: int) -> list[np.ndarray]:
    """`n` units: silence, then speech at `offset` for two units, then silence (a reply)."""
    return [SPEECH if offset <= i < offset + 2 else SILENCE for i in range(n)]


def spec(i: int) -> SessionSpec:
    # Different prompts (context lengths) and startup protections per session.
    settings = DuplexSettings(force_listen_count=i % 3)
    return SessionSpec(f"s{i}", f"l{i}", "audio", system_prompt="x" * (8 * i), settings=settings)


def outcome(event) -> tuple:
    r = event.result
    return (event.seq, r.is_listen, r.text, r.end_of_turn, r.kv_cache_length, r.audio.tobytes())


async def serve(engine, specs, scripts, runner=None, on_unit=None, limits=None):
    """Every session's units in lockstep (unit k of all, then wait for all their results):
    per session, its outcomes and its end."""
    executor = ThreadPoolExecutor(4)
    sessions = [
        DuplexSession(
            s, engine, executor, limits or SessionLimits(60, 8192), runner=runner, on_unit=on_unit
        )
        for s in specs
    ]
    for session in sessions:
        await session.open()
    running = [asyncio.ensure_future(s.run()) for s in sessions]
    seen: list[list] = [[] for _ in sessions]

    async def result_of(i: int, seq: int) -> None:
        async for event in sessions[i].journal.events():
            if isinstance(event, SessionEnd) or event.seq == seq:
                if not isinstance(event, SessionEnd):
                    seen[i].append(outcome(event))
                return

    for k in range(max(len(s) for s in scripts)):
        live = [i for i, s in enumerate(scripts) if k < len(s) and sessions[i].ended is None]
        for i in live:
            sessions[i].submit(UnitInput(seq=k + 1, pcm=scripts[i][k]))
        await asyncio.wait_for(asyncio.gather(*(result_of(i, k + 1) for i in live)), scaled(10))
    for session in sessions:
        session.close(CloseReason.USER_STOP)
    ends = await asyncio.wait_for(asyncio.gather(*running), scaled(10))
    executor.shutdown()
    return seen, ends


def batcher_for(engine, sessions: int, executor=None, **kw) -> StepBatcher:
    stepper = engine.stepper()
    assert stepper is not None
    timeout = kw.pop("timeout", None)
    return StepBatcher(
        stepper, executor or ThreadPoolExecutor(1), lambda: timeout, lambda: sessions, **kw
    )


@pytest.mark.parametrize("n", [1, 2, 4, 8])
async def test_batched_sessions_get_what_each_gets_alone(n):
    specs = [spec(i) for i in range(n)]
    scripts = [script(10, 1 + i % 4) for i in range(n)]
    engine = SyntheticEngine(compute_ms=20, batch_share=0.1, force_listen_count=0)
    alone = [(await serve(engine, [s], [sc]))[0][0] for s, sc in zip(specs, scripts, strict=True)]
    metrics = WorkerMetrics()
    batcher = batcher_for(engine, n, on_step=metrics.observe_step)
    together, ends = await serve(engine, specs, scripts, runner=batcher)
    assert together == alone
    assert all(e.reason == CloseReason.USER_STOP and e.units_served == 10 for e in ends)
    # Lockstep: every step held all n sessions.
    assert batcher.steps == 10
    count = metrics.registry.get_sample_value("omni_worker_batch_sessions_count")
    total = metrics.registry.get_sample_value("omni_worker_batch_sessions_sum")
    assert count == 10 and total == 10 * n


async def test_a_control_shows_the_comparison_can_fail():
    """A stepper that hands rows back out of order: the same comparison catches it."""
    from omnifabric.worker.engines.synthetic import SyntheticStepper

    class Swapped(SyntheticStepper):
        def step(self, rows):
            outcome = super().step(rows)
            outcome.rows.reverse()
            return outcome

    engine = SyntheticEngine(compute_ms=5, batch_share=0.1, force_listen_count=0)
    specs, scripts = [spec(0), spec(1)], [script(8, 1), script(8, 3)]
    alone = [(await serve(engine, [s], [sc]))[0][0] for s, sc in zip(specs, scripts, strict=True)]
    swapped = StepBatcher(Swapped(engine, 0.1), ThreadPoolExecutor(1), lambda: None, lambda: 2)
    together, _ = await serve(engine, specs, scripts, runner=swapped)
    assert together != alone


async def test_a_unit_waits_the_window_for_batch_mates_and_no_longer():
    engine = SyntheticEngine(compute_ms=0, batch_share=0.1, force_listen_count=0)
    # Two sessions open, one sends: its unit waits the window (50 ms) for the other.
    lone = batcher_for(engine, 2, window_s=0.05)
    started = time.perf_counter()
    await serve(engine, [spec(0)], [script(3, 1)], runner=lone)
    waited = time.perf_counter() - started
    assert waited >= 3 * 0.05
    # Every open session has a unit waiting: no wait at all.
    full = batcher_for(engine, 1, window_s=5.0)
    started = time.perf_counter()
    await serve(engine, [spec(0)], [script(3, 1)], runner=full)
    assert time.perf_counter() - started < scaled(2.0)


async def test_a_failing_row_fails_its_own_session_only():
    # Unit 2 of every session fails; the second session starts one unit later, so the step
    # that fails the first one's unit 2 holds the second one's unit 1.
    engine = SyntheticEngine(compute_ms=5, batch_share=0.1, force_listen_count=0, fail_unit=2)
    batcher = batcher_for(engine, 2)
    executor = ThreadPoolExecutor(2)
    first, second = (
        DuplexSession(spec(i), engine, executor, SessionLimits(60, 8192), runner=batcher)
        for i in range(2)
    )
    for session in (first, second):
        await session.open()
    runs = [asyncio.ensure_future(s.run()) for s in (first, second)]
    first.submit(UnitInput(seq=1, pcm=SILENCE))
    await asyncio.sleep(0.2)
    first.submit(UnitInput(seq=2, pcm=SILENCE))
    second.submit(UnitInput(seq=1, pcm=SILENCE))
    end = await asyncio.wait_for(runs[0], scaled(5))
    assert end.reason == CloseReason.ERROR and end.error_code == "inference_error"
    async for event in second.journal.events():
        if not isinstance(event, SessionEnd) and event.seq == 1:
            break
    assert second.ended is None and second.units_served == 1
    second.close(CloseReason.USER_STOP)
    assert (await asyncio.wait_for(runs[1], scaled(5))).reason == CloseReason.USER_STOP
    executor.shutdown()


async def test_a_stuck_step_fails_every_session_in_it():
    engine = SyntheticEngine(
        compute_ms=5, batch_share=0.1, force_listen_count=0, hang_unit=2, hang_s=1.0
    )
    stuck: list[str] = []
    executor = ThreadPoolExecutor(1)
    batcher = batcher_for(engine, 2, executor=executor, timeout=0.3)
    sessions = [
        DuplexSession(
            spec(i),
            engine,
            executor,
            SessionLimits(60, 8192, unit_timeout_s=0.3),
            runner=batcher,
            on_stuck=lambda s, detail: stuck.append(detail),
        )
        for i in range(2)
    ]
    for session in sessions:
        await session.open()
    runs = [asyncio.ensure_future(s.run()) for s in sessions]
    for seq in (1, 2):
        for session in sessions:
            session.submit(UnitInput(seq=seq, pcm=SILENCE))
        await asyncio.sleep(0.1)
    ends = await asyncio.wait_for(asyncio.gather(*runs), scaled(10))
    assert all(e.error_code == "inference_error" for e in ends), ends
    assert len(stuck) == 2 and all("in a step of 2" in d for d in stuck), stuck
    await asyncio.sleep(1.2)  # the hung step returns; its sessions are freed then
    executor.shutdown()


async def test_each_unit_is_charged_its_share_of_its_step():
    charged: list[float] = []

    def on_unit(session, length_s, engine_s, wall_s, speaking):
        charged.append(engine_s)

    n = 4
    engine = SyntheticEngine(compute_ms=100, batch_share=0.1, force_listen_count=0)
    await serve(
        engine,
        [spec(i) for i in range(n)],
        [[SILENCE] * 3] * n,
        runner=batcher_for(engine, n),
        on_unit=on_unit,
    )
    # A step of 4: 100 ms x (1 + 0.1 x 3) = 130 ms, 32.5 ms a unit (not 130 each).
    assert len(charged) == 3 * n
    assert all(0.030 <= c <= 0.060 for c in charged), charged
    stepper = engine.stepper()
    assert stepper is not None and stepper.added_cost(0.0325) == pytest.approx(0.01)


async def test_a_failure_of_the_driver_fails_the_waiting_sessions():
    """Not the engine's failure but the batcher's own (here: the count of open sessions
    raises): every session waiting ends with an error instead of waiting forever."""
    engine = SyntheticEngine(compute_ms=0, batch_share=0.1, force_listen_count=0)
    stepper = engine.stepper()
    assert stepper is not None

    def broken() -> int:
        raise RuntimeError("open sessions unknown")

    batcher = StepBatcher(stepper, ThreadPoolExecutor(1), lambda: None, broken)
    executor = ThreadPoolExecutor(1)
    session = DuplexSession(spec(0), engine, executor, SessionLimits(60, 8192), runner=batcher)
    await session.open()
    run = asyncio.ensure_future(session.run())
    session.submit(UnitInput(seq=1, pcm=SILENCE))
    end = await asyncio.wait_for(run, scaled(5))
    assert end.reason == CloseReason.ERROR and end.error_code == "inference_error"
    executor.shutdown()
