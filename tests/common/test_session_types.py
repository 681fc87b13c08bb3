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
