"""The edge checks units against the lengths the worker advertised in SessionStarted."""

from __future__ import annotations

import pytest

from edge.errors import InvalidPayload
from edge.session import check_unit_length


def test_lengths_outside_the_workers_range_are_invalid_payload():
    check_unit_length(8000, 4000, 64000)
    check_unit_length(4000, 4000, 64000)
    with pytest.raises(InvalidPayload, match="takes 16000 to 16000 per unit"):
        check_unit_length(8000, 16000, 16000)
    with pytest.raises(InvalidPayload, match="64001 samples"):
        check_unit_length(64001, 4000, 64000)
