"""An engine's limits (common.session_types.EngineLimits) on the wire: the one map to and
from common.proto's EngineLimits, used by the worker's hello, the scheduler's grants and
status, and the edge's readers of both."""

from __future__ import annotations

from omnifabric.common.session_types import EngineLimits
from omnifabric.omni.realtime.v1 import common_pb2


def to_pb(limits: EngineLimits) -> common_pb2.EngineLimits:
    return common_pb2.EngineLimits(
        min_slice_nums=limits.min_slice_nums,
        max_slice_nums=limits.max_slice_nums,
        min_unit_samples=limits.min_unit_samples,
        max_unit_samples=limits.max_unit_samples,
    )


def from_pb(msg: common_pb2.EngineLimits) -> EngineLimits:
    return EngineLimits(
        min_slice_nums=msg.min_slice_nums,
        max_slice_nums=msg.max_slice_nums,
        min_unit_samples=msg.min_unit_samples,
        max_unit_samples=msg.max_unit_samples,
    )
