"""gRPC's I/O layer for every omnifabric process, chosen before grpc is imported.

grpcio 1.80 made its posix EventEngine the TCP client and listener of Python processes.
Measured here (2 cores, a 64 KB request and a 96 KB answer on one grpc.aio stream, one
exchange a second): 0.78-0.86 ms p50 per round trip with it, 0.59-0.66 ms with gRPC's
older iomgr TCP code; back to back, 157 -> 96 us of client CPU per exchange. Every unit
of every session crosses one such exchange (edge -> worker), so the fabric turns both
experiments off unless the operator says otherwise.

gRPC reads GRPC_EXPERIMENTS once, when its core starts (on `import grpc`), so `choose()`
runs first thing in each entry point (`python -m omnifabric.edge|worker|scheduler`, the
`omnifabric` command) and in the tests' conftest. An operator who sets GRPC_EXPERIMENTS
(an empty value included) keeps exactly that. A grpcio that no longer has these
experiments logs "Unknown experiment" once and runs its defaults.

This module imports nothing of grpc.
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_EXPERIMENTS"
#: gRPC's EventEngine TCP client and listener off: its iomgr TCP code instead.
IOMGR_TCP = "-event_engine_client,-event_engine_listener"

_chosen_before_grpc: bool | None = None


def choose(environ: dict[str, str] | None = None) -> bool:
    """Set GRPC_EXPERIMENTS to IOMGR_TCP unless it is set. Returns whether grpc was still
    unimported (False: too late for this process; its children still inherit it)."""
    global _chosen_before_grpc
    env = os.environ if environ is None else environ
    env.setdefault(ENV, IOMGR_TCP)
    before = "grpc" not in sys.modules
    if _chosen_before_grpc is None:
        _chosen_before_grpc = before
    return before


def report() -> dict[str, object]:
    """What this process runs gRPC with, for /status: the experiments value and whether it
    was chosen before grpc loaded (None: `choose` never ran here)."""
    return {"experiments": os.environ.get(ENV, ""), "chosen_before_grpc": _chosen_before_grpc}
