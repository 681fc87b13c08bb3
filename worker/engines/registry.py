"""The engine registry: engine name -> factory, and `load_engine` to look one up.

Engine modules import only the interface (worker.engine); this module imports the engines,
each inside its factory, so choosing one engine never imports another's dependencies.
"""

from __future__ import annotations

from collections.abc import Callable

from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.engine import Engine
from omnifabric.worker.errors import EngineUnavailable


def _synthetic(config: WorkerConfig) -> Engine:
    from omnifabric.worker.engines.synthetic import SyntheticEngine

    return SyntheticEngine(
        compute_ms=config.synthetic_compute_ms,
        finalize_ms=config.synthetic_finalize_ms,
        threads=config.synthetic_threads,
        cpu_bound=config.synthetic_cpu_bound,
        slots=config.slots or 4,
        fail_unit=config.synthetic_fail_unit,
        hang_unit=config.synthetic_hang_unit,
        batch_share=config.synthetic_batch_share,
    )


def _reference(config: WorkerConfig) -> Engine:
    from omnifabric.worker.engines.reference.engine import ReferenceEngine
    from omnifabric.worker.engines.reference.turns import TurnRules

    rules = TurnRules(
        min_speech_s=config.turn_min_speech_s,
        end_silence_s=config.turn_end_silence_s,
        turn_work=config.turn_work,
    )
    engine = ReferenceEngine(
        slots=config.slots or 5,
        rules=rules,
        device=config.device or "cpu",
        llm_threads=config.llm_threads,
        llm_model=config.llm_model,
        asr=config.asr,
        asr_precision=config.asr_precision,
    )
    # Without --slots: as many as keep real time by the warm-up's measure.
    engine.slots_from_warmup = config.slots is None
    return engine


def _minicpmo(config: WorkerConfig) -> Engine:
    from omnifabric.worker.engines.minicpmo import MiniCPMOEngine
    from omnifabric.worker.engines.minicpmo.step import MiniCPMOStepper

    # Batched steps (--slots > 1): the step drives the engine's sessions, so the engine
    # gets its class here rather than importing it.
    return MiniCPMOEngine.from_config(config, stepper_class=MiniCPMOStepper)


#: Engine name -> factory that builds it from the worker's config (not yet loaded).
ENGINES: dict[str, Callable[[WorkerConfig], Engine]] = {
    "synthetic": _synthetic,
    "reference": _reference,
    "minicpmo": _minicpmo,
}


def load_engine(name: str, config: WorkerConfig) -> Engine:
    """The engine called `name`, loaded (not yet warmed up). Raises EngineUnavailable."""
    factory = ENGINES.get(name)
    if factory is None:
        raise EngineUnavailable(
            f"unknown engine {name!r} (choose synthetic, reference or minicpmo)"
        )
    engine = factory(config)
    engine.load()
    return engine
