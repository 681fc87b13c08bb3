"""The MiniCPM-o 4.5 engine (production): the model's own public code, every layout."""

from omnifabric.worker.engines.minicpmo.engine import (
    MiniCPMOEngine,
    MiniCPMOSession,
    check_model_dir,
    check_runtime,
)

__all__ = ["MiniCPMOEngine", "MiniCPMOSession", "check_model_dir", "check_runtime"]
