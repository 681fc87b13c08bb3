"""Scheduler settings from the environment."""

from __future__ import annotations

import pytest

from omnifabric.scheduler.config import SchedulerConfig


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


def test_drain_limits_and_tls_settings() -> None:
    config = SchedulerConfig.from_env(
        {
            "OMNI_SCHEDULER_DRAIN_GRACE_S": "2.5",
            "OMNI_SCHEDULER_MAX_MESSAGE_BYTES": "65536",
            "OMNI_FABRIC_TLS_CA": "/etc/omni/ca.pem",
            "OMNI_FABRIC_TLS_CERT": "/etc/omni/node.pem",
            "OMNI_FABRIC_TLS_KEY": "/etc/omni/node.key",
        }
    )
    assert (config.drain_grace_s, config.max_message_bytes) == (2.5, 65536)
    assert (config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key) == (
        "/etc/omni/ca.pem",
        "/etc/omni/node.pem",
        "/etc/omni/node.key",
    )
    defaults = SchedulerConfig.from_env({})
    assert (defaults.drain_grace_s, defaults.max_message_bytes) == (5.0, 8 * 1024 * 1024)
    assert defaults.fabric_tls_cert is None
    with pytest.raises(ValueError, match="OMNI_SCHEDULER_MAX_MESSAGE_BYTES"):
        SchedulerConfig.from_env({"OMNI_SCHEDULER_MAX_MESSAGE_BYTES": "10"})
    with pytest.raises(ValueError, match="OMNI_SCHEDULER_DRAIN_GRACE_S"):
        SchedulerConfig.from_env({"OMNI_SCHEDULER_DRAIN_GRACE_S": "-1"})
    with pytest.raises(ValueError, match="OMNI_FABRIC_TLS_CERT and OMNI_FABRIC_TLS_KEY"):
        SchedulerConfig.from_env({"OMNI_FABRIC_TLS_CERT": "/etc/omni/node.pem"})


def test_ha_is_off_by_default_and_a_bad_address_is_named() -> None:
    import subprocess
    import sys

    from omnifabric.common.config import ConfigError

    assert SchedulerConfig.from_env({}).ha is None
    config = SchedulerConfig.from_env(
        {"OMNI_SCHEDULER_HA": "redis://127.0.0.1:6379/1", "OMNI_SCHEDULER_HA_TTL_S": "1.5"}
    )
    assert (config.ha, config.ha_ttl_s) == ("redis://127.0.0.1:6379/1", 1.5)
    with pytest.raises(ConfigError, match=r"^OMNI_SCHEDULER_HA database must be a number"):
        SchedulerConfig.from_env({"OMNI_SCHEDULER_HA": "redis://h:1/x"})
    with pytest.raises(ConfigError, match=r"^OMNI_SCHEDULER_HA_TTL_S must be in 0.3..60"):
        SchedulerConfig.from_env({"OMNI_SCHEDULER_HA_TTL_S": "0.1"})
    # Without --ha the scheduler never imports redis.
    code = (
        "import sys; from omnifabric.scheduler import main, server; "
        "sys.exit('redis' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
