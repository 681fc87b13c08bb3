"""The worker's data plane: engine, engine threads, lease book, live sessions, health.

The gRPC servicer and the registration client call into it; it holds no protobuf.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from omnifabric.common import realtime
from omnifabric.worker.batcher import StepBatcher
from omnifabric.worker.config import STUCK_MULTIPLE, WorkerConfig
from omnifabric.worker.engine import ChatChunk, ChatTurn, Engine
from omnifabric.worker.engines import memory
from omnifabric.worker.errors import (
    EngineFailure,
    InvalidRequest,
    LeaseNotFound,
    ModeMismatch,
    NoFreeSlot,
    NotServing,
)
from omnifabric.worker.headroom import Headroom, HeadroomFigures
from omnifabric.worker.leases import LeaseBook
from omnifabric.worker.metrics import WorkerMetrics
from omnifabric.worker.session import DuplexSession
from omnifabric.worker.session_types import CloseReason, SessionLimits, SessionSpec

log = logging.getLogger("omnifabric.worker")


class _End(enum.Enum):
    """What next() gives for an engine's exhausted chat chunks (a typed sentinel)."""

    END = enum.auto()


def _next_timed(chunks: Iterator[ChatChunk]) -> tuple[ChatChunk | _End, float]:
    """The engine's next chat chunk (or END), on an engine thread, and the seconds it took
    there (a wait for a free thread left out)."""
    t0 = time.perf_counter()
    chunk = next(chunks, _End.END)
    return chunk, time.perf_counter() - t0


@dataclass(frozen=True)
class Health:
    """Whether the worker takes new sessions, and why not."""

    serving: bool
    detail: str = ""


class WorkerRuntime:
    """Opens sessions on the engine against granted leases; tracks them until freed."""

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.slots = config.slots or engine.default_slots
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, engine.concurrency), thread_name_prefix="engine"
        )
        self.leases = LeaseBook()
        self.sessions: dict[str, DuplexSession] = {}
        """Live sessions by lease id."""
        self.chats = 0
        """Chat turns being generated (each holds a slot)."""
        self._tasks: set[asyncio.Task[object]] = set()
        self.health = Health(False, "warming up")
        self.health_listeners: list[Callable[[Health], None]] = []
        self.baseline: memory.MemoryReport | None = None
        self.last_cleanup: memory.MemoryReport | None = None
        self.cleanups = 0
        self.memory_listeners: list[Callable[[], None]] = []
        """Called after warm-up and after every session cleanup (memory figures changed)."""
        self.draining = False
        self.stuck: dict[str, str] = {}
        """Sessions whose engine call overran the unit timeout and has not returned yet:
        session id -> detail. The worker is NOT_SERVING while any is stuck. After a drain,
        "drain" marks sessions that outlived the grace (their calls may never return)."""
        self.headroom: Headroom | None = None
        """What the engine spends per session and whether the worker keeps real time; made
        at warm-up (its estimates come from it)."""
        self.metrics = WorkerMetrics(self)
        """Prometheus instruments (served on --metrics-port by worker.main)."""
        self.stepper = engine.stepper() if config.batching == "on" else None
        """The engine's batched entry, when batching is on and the engine has one."""
        self.batcher = (
            None
            if self.stepper is None
            else StepBatcher(
                self.stepper,
                self.executor,
                self.unit_timeout_s,
                lambda: len(self.sessions),
                window_s=config.batch_window_ms / 1000.0,
                on_step=self.metrics.observe_step,
            )
        )
        """Runs every session's units in batched steps; None: each session runs its own one
        by one (time-sliced)."""
        self.engine_threads = 1 if self.batcher is not None else max(1, engine.concurrency)
        """Units the engine computes at once: one step at a time when batched, else one per
        engine thread, or as many as the engine measured at warm-up to run at full speed
        together (the real-time headroom's engine seconds per second)."""
        if self.batcher is not None:
            log.info(
                "batched steps: one engine call serves a unit of every session that has one "
                "waiting (a unit waits up to %g ms for batch-mates; --batching off: one by one)",
                config.batch_window_ms,
            )

    def set_health(self, serving: bool, detail: str = "") -> None:
        """Change health and tell the listeners (health service, scheduler) on a change."""
        health = Health(serving, "" if serving else detail)
        if health == self.health:
            return
        self.health = health
        log.info(
            "health: %s%s",
            "SERVING" if serving else "NOT_SERVING",
            f" ({detail})" if detail else "",
        )
        for listener in list(self.health_listeners):
            listener(health)

    async def warmup(self) -> None:
        """Run one real unit through the engine, note the memory baseline, then SERVING."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        await loop.run_in_executor(self.executor, self.engine.warmup)
        self._measure_headroom(time.perf_counter() - started)
        self.baseline = await loop.run_in_executor(self.executor, memory.cleanup)
        await loop.run_in_executor(self.executor, memory.freeze_long_lived)
        if not self.draining:
            self.set_health(True)  # the SERVING report carries the baseline figures

    def _measure_headroom(self, warmup_s: float) -> None:
        """The engine's cost estimates from its warm-up; an engine that sizes its slots by
        them gets as many as keep real time (unless --slots says otherwise)."""
        engine = self.engine
        if self.batcher is None and engine.parallel_units is not None:
            self.engine_threads = max(1, min(engine.concurrency, engine.parallel_units))
        estimates = {mode: engine.cost_estimate(mode, warmup_s) for mode in engine.modes}
        added_cost = engine.added_cost if self.stepper is None else self.stepper.added_cost
        # A batched step serves its rows together: their dearest units do not queue behind
        # each other (the means, by the step's fitted slope, govern there).
        self.headroom = Headroom(
            self.engine_threads,
            estimates,
            added_cost,
            self.config.headroom_window_s,
            added_peak=None if self.stepper is None else (lambda _peak: 0.0),
        )
        costs = self.headroom.figures().costs
        log.info(
            "warm-up took %.2f s; engine seconds a session costs per second: %s, on %d engine "
            "threads",
            warmup_s,
            ", ".join(f"{mode} {cost.session_cost:.3f}" for mode, cost in sorted(costs.items())),
            self.engine_threads,
        )
        slowest = engine.slowest_call_s()
        if slowest is not None:
            log.info(
                "unit timeout: %.1f s (the engine's dearest call measures %.2f s here; %g "
                "times that, or --unit-timeout %g s where longer)",
                self.unit_timeout_s(),
                slowest,
                STUCK_MULTIPLE,
                self.config.unit_timeout_s,
            )
        if self.config.slots is None and engine.slots_from_warmup and "audio" in costs:
            audio = costs["audio"]
            self.slots = realtime.sessions_within(
                self.engine_threads, audio.session_cost, audio.added_cost, realtime.MARGIN
            )
            log.info(
                "slots: %d, the audio sessions that keep real time by the warm-up's measure "
                "(%.0f%% of %d engine threads; --slots overrides)",
                self.slots,
                realtime.MARGIN * 100,
                self.engine_threads,
            )

    def unit_timeout_s(self) -> float:
        """The bound on one engine call of a unit now: the configured unit timeout, or
        STUCK_MULTIPLE times the engine's measure of its dearest call where that is longer.
        A session keeps the one it started with (SessionStarted.unit_timeout_ms tells the
        edge, whose watchdog outwaits it)."""
        configured = self.config.unit_timeout_s
        slowest = self.engine.slowest_call_s()
        return configured if slowest is None else max(configured, STUCK_MULTIPLE * slowest)

    def headroom_figures(self) -> HeadroomFigures | None:
        """What the worker reports of its headroom now (None before warm-up)."""
        return None if self.headroom is None else self.headroom.figures()

    def _unit_served(
        self,
        session: DuplexSession,
        length_s: float,
        engine_s: float,
        wall_s: float,
        speaking: bool,
    ) -> None:
        if self.headroom is not None:
            self.headroom.unit(
                session.spec.mode, session.lease_id, length_s, engine_s, wall_s, speaking
            )

    async def open_session(self, spec: SessionSpec) -> DuplexSession:
        """Claim the lease, open and prepare the engine session, start its unit loop.

        Raises NotServing, LeaseNotFound, LeaseInUse, ModeMismatch, NoFreeSlot, EngineFailure.
        """
        if self.draining or self.baseline is None:
            raise NotServing("worker is not taking sessions (warming up or draining)")
        if self.stuck:
            raise NotServing("worker is not taking sessions (an engine call is stuck)")
        holder: list[DuplexSession] = []
        revoked: list[str] = []

        def on_revoke(reason: str) -> None:
            revoked.append(reason)
            if holder:
                holder[0].close(CloseReason.CLIENT_CLOSED, f"lease revoked: {reason}")

        await self.leases.claim(spec.lease_id, spec.mode, self.config.lease_wait_s, on_revoke)
        try:
            if len(self.sessions) >= self.slots:
                raise NoFreeSlot(f"all {self.slots} slots of this worker are taken")
            limits = SessionLimits(
                duration_s=self.config.limit_s(spec.mode),
                max_context_tokens=self.config.max_context_tokens,
                unit_timeout_s=self.unit_timeout_s(),
                journal_results=self.config.journal_results,
            )
            session = DuplexSession(
                spec,
                self.engine,
                self.executor,
                limits,
                self._on_freed,
                on_stuck=self._on_stuck,
                on_unstuck=self._on_unstuck,
                on_unit=self._unit_served,
                runner=self.batcher,
            )
            holder.append(session)
            self.sessions[spec.lease_id] = session
            await session.open()
        except BaseException:
            self.sessions.pop(spec.lease_id, None)
            self.leases.release(spec.lease_id)
            raise
        task: asyncio.Task[object] = asyncio.ensure_future(session.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if revoked:
            session.close(CloseReason.CLIENT_CLOSED, f"lease revoked: {revoked[0]}")
        if self.draining:
            session.close(CloseReason.SERVER_SHUTDOWN)
        return session

    def resumable(self, lease_id: str, session_id: str) -> DuplexSession:
        """The running session of this lease, for a resumed stream. Raises LeaseNotFound
        when there is none (never started, ended, or another session's id)."""
        session = self.sessions.get(lease_id)
        if (
            session is None
            or session.ended is not None
            or (session_id and session.session_id != session_id)
            or session.spec.resume_grace_s <= 0
        ):
            raise LeaseNotFound(f"no resumable session {session_id} on lease {lease_id}")
        return session

    async def chat(self, lease_id: str, turn: ChatTurn) -> AsyncIterator[ChatChunk]:
        """One chat turn under a chat lease: the engine's chunks, produced on the engine
        threads; the lease is released (and memory cleaned) when the turn ends or the
        caller stops iterating. Raises like open_session, and EngineFailure."""
        if self.draining or self.baseline is None:
            raise NotServing("worker is not taking sessions (warming up or draining)")
        if self.stuck:
            raise NotServing("worker is not taking sessions (an engine call is stuck)")
        if "chat" not in self.engine.modes:
            raise ModeMismatch(f"engine {self.engine.name!r} does not serve chat")
        revoked: list[str] = []
        await self.leases.claim(lease_id, "chat", self.config.lease_wait_s, revoked.append)
        self.chats += 1
        loop = asyncio.get_running_loop()
        started, engine_s = time.perf_counter(), 0.0
        try:
            if len(self.sessions) + self.chats > self.slots:
                raise NoFreeSlot(f"all {self.slots} slots of this worker are taken")
            chunks = iter(await loop.run_in_executor(self.executor, self._open_chat, turn))
            while not revoked:
                try:
                    chunk, spent = await loop.run_in_executor(self.executor, _next_timed, chunks)
                except ValueError as exc:
                    raise InvalidRequest(str(exc)) from None
                except Exception as exc:
                    raise EngineFailure("inference failed") from exc
                engine_s += spent
                if chunk is _End.END:
                    return
                yield chunk
        finally:
            if self.headroom is not None:
                self.headroom.chat_turn(engine_s, time.perf_counter() - started)
            self.chats -= 1
            self.leases.release(lease_id)
            report = await loop.run_in_executor(self.executor, memory.cleanup)
            self._check_memory(report)

    def _open_chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        """The engine's chunk iterator (a generator starts lazily, so nothing runs yet)."""
        return iter(self.engine.chat(turn))

    def _on_freed(self, session: DuplexSession, report: memory.MemoryReport | None) -> None:
        self.sessions.pop(session.lease_id, None)
        if self.headroom is not None:
            self.headroom.session_ended(session.lease_id)
        self.leases.release(session.lease_id)
        if session.ended is not None:
            self.metrics.observe_end(session.ended)
        self._check_memory(report)

    def _on_stuck(self, session: DuplexSession, detail: str) -> None:
        """An engine call hangs: no new leases until it returns (it cannot be killed)."""
        self.stuck[session.session_id] = detail
        if not self.draining:
            self.set_health(False, detail)

    def _on_unstuck(self, session: DuplexSession, report: memory.MemoryReport | None) -> None:
        """The stuck call returned and its engine session is freed: serve again when no
        other call is stuck (and, on CUDA, memory is back at the baseline)."""
        self.stuck.pop(session.session_id, None)
        if not self.draining and self.health.detail.startswith("engine stuck"):
            if self.stuck:
                self.set_health(False, next(iter(self.stuck.values())))
            else:
                self.set_health(True)
        self._check_memory(report)

    def _memory_changed(self) -> None:
        for listener in list(self.memory_listeners):
            listener()

    def _check_memory(self, report: memory.MemoryReport | None) -> None:
        """Record the cleanup's figures; on CUDA, hold new leases back while memory is not
        back at the baseline."""
        if report is not None:
            self.last_cleanup = report
            self.cleanups += 1
            self._memory_changed()
        if report is None or self.baseline is None or report.device != "cuda" or self.draining:
            return
        if self.sessions:
            return
        excess = report.after_bytes - self.baseline.after_bytes
        if excess > self.config.memory_tolerance_mb * 2**20:
            self.set_health(False, f"memory not back: {excess / 2**20:.0f} MiB over baseline")
        elif not self.health.serving and self.health.detail.startswith("memory"):
            self.set_health(True)

    async def drain(self, grace: float) -> None:
        """NOT_SERVING, end every session in-band with SERVER_SHUTDOWN, wait up to `grace` s."""
        self.draining = True
        self.set_health(False, "draining")
        for session in list(self.sessions.values()):
            session.close(CloseReason.SERVER_SHUTDOWN)
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                # Their engine calls may never return: the process must not wait for them.
                self.stuck["drain"] = f"{len(pending)} sessions still running after the grace"
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    def shutdown(self) -> None:
        """Release the engine threads (after drain)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
