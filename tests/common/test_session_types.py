"""The session types edge, worker and scheduler share are written once (common.session_types,
common.close_reasons): each service's name for one is the same class, and each keeps
working the way its service uses it."""

from __future__ import annotations

import dataclasses

import pytest

from omnifabric.common.close_reasons import CloseReason
from omnifabric.common.session_types import DuplexSettings, EngineLimits, Usage
from omnifabric.edge import events as ev
from omnifabric.edge.worker_client import config_to, usage_from
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.scheduler import registry
from omnifabric.worker import engine, session_types
from omnifabric.worker.errors import InvalidRequest
from omnifabric.worker.service import check_slices, decode_settings, encode_usage


def test_each_service_names_the_one_class():
    assert ev.DuplexSettings is engine.DuplexSettings is DuplexSettings
    assert ev.Usage is session_types.Usage is Usage
    assert engine.EngineLimits is registry.EngineLimits is EngineLimits
    assert session_types.CloseReason is CloseReason


def test_usage_counted_up_by_parts_keeps_its_totals():
    """The worker's way: parts set and added to after the start; totals follow."""
    usage = Usage()
    usage.input_text_tokens = 10
    usage.input_audio_tokens += 3
    usage.input_vision_tokens += 4
    usage.output_text_tokens += 2
    usage.output_audio_tokens += 5
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (17, 7, 24)
    snapshot = dataclasses.replace(usage)
    usage.output_text_tokens += 1
    assert snapshot.total_tokens == 24 and usage.total_tokens == 25


def test_usage_given_totals_are_kept():
    """The edge's way: a Usage message's totals as they came; absent ones are sums."""
    assert Usage(total_tokens=9).total_tokens == 9
    assert Usage(total_tokens=9).input_tokens == 0
    assert Usage(input_audio_tokens=4, output_text_tokens=1).total_tokens == 5
    usage = Usage(input_tokens=5, output_tokens=2, total_tokens=7)
    assert common_pb2.Usage(**usage.__dict__).total_tokens == 7  # only the message's names


def test_usage_round_trips_from_worker_to_edge():
    usage = Usage()
    usage.input_text_tokens = 3
    usage.output_audio_tokens += 8
    assert usage_from(encode_usage(usage)) == usage


def test_duplex_settings_send_no_max_slice_nums():
    """DuplexConfig has no max_slice_nums (SessionStart carries it): the edge leaves it out,
    the worker fills it from the start."""
    settings = DuplexSettings(temperature=0.5, seed=3)
    assert settings.given() == {"temperature": 0.5, "seed": 3}
    config = config_to(settings)
    assert decode_settings(config, 2) == dataclasses.replace(settings, max_slice_nums=2)
    assert decode_settings(config, 0).max_slice_nums == 1


def test_engine_limits_refuse_as_the_worker_does():
    limits = EngineLimits(max_slice_nums=4)
    check_slices(limits, 0)
    check_slices(limits, 4)
    assert limits.slices_refusal(2) == ""
    with pytest.raises(
        InvalidRequest, match=r"^unit 2 max_slice_nums: 9; this worker takes 1 to 4$"
    ):
        check_slices(limits, 9, "unit 2 max_slice_nums")


def test_a_session_window_over_the_operators_under_the_context_cap():
    from omnifabric.common.session_types import ContextWindow

    operator = ContextWindow(mode="basic")  # the public code's defaults: 8000 / 6000
    assert operator.within(8192) == operator
    fitted = operator.within(4096)
    assert (fitted.high_tokens, fitted.low_tokens) == (4096 - 192, (4096 - 192) * 3 // 4)
    # The session's own values win; lowering only the high watermark lowers the low one.
    own = operator.for_session(DuplexSettings(window_high_tokens=400), 8192).window()
    assert (own.mode, own.high_tokens, own.low_tokens) == ("basic", 400, 300)
    off = ContextWindow().for_session(DuplexSettings(context_window="context"), 8192)
    assert off.window().mode == "context" and off.window().units == 24
    for bad in (
        DuplexSettings(context_window="basic", window_high_tokens=8100),
        DuplexSettings(context_window="basic", window_high_tokens=500, window_low_tokens=500),
        DuplexSettings(context_window="sideways"),
    ):
        with pytest.raises(ValueError, match="window|context_window"):
            operator.for_session(bad, 8192)


def test_the_operators_window_is_checked_at_start():
    from omnifabric.common.config import ConfigError
    from omnifabric.worker.config import WorkerConfig

    config = WorkerConfig.from_env({}, context_window="context", window_units=6)
    assert config.window().units == 6 and config.window().mode == "context"
    with pytest.raises(ConfigError, match="window_low_tokens"):
        WorkerConfig.from_env(
            {}, context_window="basic", window_low_tokens=7000, window_high_tokens=700
        )
    assert WorkerConfig.from_env({}, audio_limit_s=0.0).limit_s("audio") == 0.0
