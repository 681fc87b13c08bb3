"""Several scheduler addresses: the setting's form and its errors."""

from __future__ import annotations

import pytest

from omnifabric.common.config import ConfigError
from omnifabric.common.schedulers import addresses
from omnifabric.edge.config import EdgeConfig
from omnifabric.worker.config import WorkerConfig


def test_one_or_several_addresses() -> None:
    assert addresses("127.0.0.1:50051") == ("127.0.0.1:50051",)
    assert addresses(" a:1, b:2 ,") == ("a:1", "b:2")
    with pytest.raises(ValueError, match="names no scheduler address"):
        addresses(" , ")
    with pytest.raises(ValueError, match="'b' is not host:port"):
        addresses("a:1,b")


def test_worker_and_edge_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="^OMNI_WORKER_SCHEDULER 'x' is not host:port"):
        WorkerConfig.from_env({"OMNI_WORKER_SCHEDULER": "x"})
    with pytest.raises(ConfigError, match="^OMNI_EDGE_SCHEDULER 'x' is not host:port"):
        EdgeConfig.from_env({"OMNI_EDGE_SCHEDULER": "x"})
    assert WorkerConfig.from_env({"OMNI_WORKER_SCHEDULER": "a:1,b:2"}).scheduler_address
