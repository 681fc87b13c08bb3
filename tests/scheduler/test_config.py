"""Scheduler settings from the environment."""

from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig


def test_defaults() -> None:
    config = SchedulerConfig.from_env({})
    assert (config.host, config.port, config.queue_max) == ("127.0.0.1", 50051, 100)
    assert config.queue_update_interval_s == 3.0
    assert (config.eta_alpha, config.eta_initial_s, config.release_timeout_s) == (0.2, 60.0, 10.0)


def test_from_env_reads_variables() -> None:
    config = SchedulerConfig.from_env(
        {
            "OMNI_SCHEDULER_HOST": "0.0.0.0",
            "OMNI_SCHEDULER_PORT": "0",
            "OMNI_SCHEDULER_QUEUE_MAX": "7",
            "OMNI_SCHEDULER_QUEUE_UPDATE_INTERVAL_S": "0.5",
            "OMNI_SCHEDULER_RELEASE_TIMEOUT_S": "2",
        }
    )
    assert (config.host, config.port, config.queue_max) == ("0.0.0.0", 0, 7)
    assert (config.queue_update_interval_s, config.release_timeout_s) == (0.5, 2.0)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("OMNI_SCHEDULER_PORT", "70000"),
        ("OMNI_SCHEDULER_PORT", "x"),
        ("OMNI_SCHEDULER_QUEUE_MAX", "0"),
        ("OMNI_SCHEDULER_ETA_ALPHA", "1.5"),
        ("OMNI_SCHEDULER_QUEUE_UPDATE_INTERVAL_S", "nan"),
    ],
)
def test_bad_value_names_variable(var: str, raw: str) -> None:
    with pytest.raises(ValueError, match=var):
        SchedulerConfig.from_env({var: raw})
