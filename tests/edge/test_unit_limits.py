"""The edge checks units against what the worker advertised: lengths in SessionStarted,
max_slice_nums in its limits (carried by the lease)."""

from __future__ import annotations

import pytest

from omnifabric.edge.errors import InvalidPayload
from omnifabric.edge.session import check_unit_length
from omnifabric.edge.worker_client import check_slices, lease_from
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb


def test_lengths_outside_the_workers_range_are_invalid_payload():
    check_unit_length(8000, 4000, 64000)
    check_unit_length(4000, 4000, 64000)
    with pytest.raises(InvalidPayload, match="takes 16000 to 16000 per unit"):
        check_unit_length(8000, 16000, 16000)
    with pytest.raises(InvalidPayload, match="64001 samples"):
        check_unit_length(64001, 4000, 64000)


def test_slices_are_checked_against_the_leases_limits_only_when_it_has_some():
    lease = scheduler_pb.Lease(
        limits=common_pb2.EngineLimits(
            min_slice_nums=1, max_slice_nums=2, min_unit_samples=4000, max_unit_samples=64000
        )
    )
    limits = lease_from(lease).limits
    assert limits is not None and limits.max_unit_samples == 64000
    check_slices(limits, 0)  # unset: the session's value
    check_slices(limits, 2)
    with pytest.raises(InvalidPayload, match=r"^max_slice_nums: 3; this server takes 1 to 2$"):
        check_slices(limits, 3)
    # No limits on the lease (an older scheduler or worker): forwarded, the worker decides.
    check_slices(None, 9)
    assert lease_from(scheduler_pb.Lease()).limits is None
    check_slices(lease_from(scheduler_pb.Lease(limits=common_pb2.EngineLimits())).limits, 9)
