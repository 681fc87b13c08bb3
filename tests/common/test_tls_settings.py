"""The fabric's TLS settings, declared once (common.tls.FabricTls) and included by the
edge's, worker's and scheduler's configs: the same variables and flags everywhere, and a
certificate without its key (or a key without its certificate) refused by each."""

from __future__ import annotations

import argparse

import pytest

from omnifabric.common import config as settings
from omnifabric.common.config import ConfigError
from omnifabric.common.tls import FabricTls
from omnifabric.edge.config import EdgeConfig
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.worker.config import WorkerConfig

CONFIGS = [EdgeConfig, WorkerConfig, SchedulerConfig]
FILES = {
    "OMNI_FABRIC_TLS_CA": "ca.pem",
    "OMNI_FABRIC_TLS_CERT": "node.pem",
    "OMNI_FABRIC_TLS_KEY": "node.key",
}


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_one_declaration_read_from_the_same_variables_and_flags(cls):
    shared = settings.settings(FabricTls)
    assert {k: v for k, v in settings.settings(cls).items() if k in shared} == shared
    config = settings.load(cls, FILES)
    assert (config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key) == (
        "ca.pem",
        "node.pem",
        "node.key",
    )
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, cls)
    args = parser.parse_args(["--fabric-tls-ca", "a", "--fabric-tls-cert", "c"])
    flags = settings.flag_values(args, cls)
    config = settings.load(cls, {"OMNI_FABRIC_TLS_KEY": "k"}, flags)
    assert (config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key) == ("a", "c", "k")
    assert settings.load(cls, {}).fabric_tls_ca is None


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("half", ["OMNI_FABRIC_TLS_CERT", "OMNI_FABRIC_TLS_KEY"])
def test_half_a_pair_is_refused_by_every_service(cls, half):
    with pytest.raises(ConfigError, match="OMNI_FABRIC_TLS_CERT and OMNI_FABRIC_TLS_KEY") as info:
        settings.load(cls, {half: "x.pem"})
    assert "(--fabric-tls-cert, --fabric-tls-key) must be set together" in str(info.value)
    settings.load(cls, {"OMNI_FABRIC_TLS_CA": "ca.pem"})  # a CA alone: TLS channels only


def test_the_worker_and_scheduler_read_the_shared_fields():
    for cls in (WorkerConfig, SchedulerConfig):
        config = settings.load(cls, FILES)
        assert (config.fabric_tls_ca, config.fabric_tls_cert, config.fabric_tls_key) == (
            "ca.pem",
            "node.pem",
            "node.key",
        )
