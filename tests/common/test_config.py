"""The one configuration scheme: defaults, OMNI_* variables, flags on top; every error names
where the bad value came from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from omnifabric.common import config as settings
from omnifabric.common.config import ConfigError, setting
from omnifabric.edge.config import EdgeConfig
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.worker.config import WorkerConfig


@dataclass(frozen=True)
class Demo:
    port: int = setting(8000, env="OMNI_DEMO_PORT", flag="--port", range=(0, 65535), help="p")
    ratio: float | None = setting(None, env="OMNI_DEMO_RATIO", range=(0.0, 1.0))
    mode: str = setting("a", env="OMNI_DEMO_MODE", flag="--mode", choices=("a", "b"))
    verbose: bool = setting(False, env="OMNI_DEMO_VERBOSE", flag="--verbose")
    origins: tuple[str, ...] = setting((), env="OMNI_DEMO_ORIGINS", flag="--origin", repeat=True)
    fixed: str = "kept"

    def __post_init__(self) -> None:
        settings.check(self)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="demo", exit_on_error=False)
    settings.add_flags(parser, Demo)
    return parser.parse_args(argv)


def test_defaults_then_variables_then_flags():
    env = {"OMNI_DEMO_PORT": "9000", "OMNI_DEMO_RATIO": "0.5", "OMNI_DEMO_VERBOSE": "yes"}
    assert settings.load(Demo, {}) == Demo()
    assert settings.load(Demo, env) == Demo(port=9000, ratio=0.5, verbose=True)
    args = parse(["--port", "7000", "--origin", "https://a", "--origin", "https://b"])
    config = settings.load(Demo, env, settings.flag_values(args, Demo))
    assert (config.port, config.ratio, config.origins) == (7000, 0.5, ("https://a", "https://b"))
    assert settings.load(Demo, {"OMNI_DEMO_ORIGINS": "https://a, https://b"}).origins == (
        "https://a",
        "https://b",
    )
    assert settings.load(Demo, {"OMNI_DEMO_RATIO": "none"}).ratio is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OMNI_DEMO_PORT": "x"}, "OMNI_DEMO_PORT must be an integer, got 'x'"),
        ({"OMNI_DEMO_PORT": "70000"}, "OMNI_DEMO_PORT must be in 0..65535, got 70000"),
        ({"OMNI_DEMO_RATIO": "nan"}, "OMNI_DEMO_RATIO must be in 0..1, got nan"),
        ({"OMNI_DEMO_MODE": "c"}, "OMNI_DEMO_MODE must be one of a, b, got 'c'"),
        ({"OMNI_DEMO_VERBOSE": "maybe"}, "OMNI_DEMO_VERBOSE must be one of"),
    ],
)
def test_a_bad_variable_is_named(env, message):
    with pytest.raises(ConfigError) as info:
        settings.load(Demo, env)
    assert str(info.value).startswith(message)


def test_a_bad_flag_is_named_and_beats_a_good_variable():
    with pytest.raises(argparse.ArgumentError, match="--port must be in 0..65535, got 70000"):
        parse(["--port", "70000"])
    with pytest.raises(argparse.ArgumentError, match="--mode must be one of a, b"):
        parse(["--mode", "c"])
    # A value checked only when the config is built still names the flag that gave it.
    with pytest.raises(ConfigError, match="^--port must be in"):
        settings.load(Demo, {"OMNI_DEMO_PORT": "1"}, {"port": -5})


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match="OMNI_DEMO_PORT"):
        Demo(port=-1)


def test_help_names_the_variable_and_default():
    parser = argparse.ArgumentParser(prog="demo")
    settings.add_flags(parser, Demo)
    text = parser.format_help()
    assert "env OMNI_DEMO_PORT, default 8000" in text
    assert "--verbose" in text and "--ratio" not in text  # no flag: variable only


@pytest.mark.parametrize("cls", [EdgeConfig, SchedulerConfig, WorkerConfig])
def test_every_service_declares_its_settings(cls):
    """Each service's config reads its variables through the shared scheme, and their names
    follow the OMNI_* convention."""
    declared = settings.settings(cls)
    assert len(declared) >= 10
    assert all(spec.env.startswith("OMNI_") for spec in declared.values())
    flags = [flag for spec in declared.values() for flag in spec.flags]
    assert len(flags) == len(set(flags)), "a flag used twice"


def test_the_watches_on_a_slow_unit_are_ordered():
    """A unit that takes long is judged first by its worker (the engine timeout ends the
    session with inference_error), a silent worker process by the scheduler (its leases
    end); the edge's unit watchdog comes last, so it never closes a session of a healthy
    worker whose engine is slow but within the worker's limit."""
    edge = EdgeConfig.from_env({}).unit_timeout_s
    worker = WorkerConfig.from_env({}).unit_timeout_s
    scheduler = SchedulerConfig.from_env({}).worker_timeout_s
    assert scheduler < worker < edge
