"""One loaded reference engine for the files here that drive real sessions through it."""

from __future__ import annotations

import pytest

from omnifabric.worker.engines.reference.engine import ReferenceEngine
from omnifabric.worker.engines.reference.turns import TurnRules


@pytest.fixture(scope="package")
def inline_engine() -> ReferenceEngine:
    """A reference engine of 2 slots, loaded once for the package (~4 s on a 2-core host),
    whose turn's end is worked out by the unit that ends it ("inline": exact timelines
    whatever a unit costs on this machine), and whose finalizes guess at a unit that ended
    in speech whatever the guess costs (``TurnRules.guess_in_time``: the same reason).
    Its tests open their own sessions and put back any setting they change, so sharing it
    is safe; test_engine warms it up."""
    engine = ReferenceEngine(slots=2, rules=TurnRules(turn_work="inline", guess_in_time=False))
    engine.load()
    return engine
