"""vocoder_flow's pieces that need neither the model code nor the vocoder package (the whole
solver is compared with the package in test_vocoder_batch.py, where it is installed)."""

from __future__ import annotations

import pytest
import torch

from omnifabric.worker.engines.minicpmo.vocoder_flow import KEPT_TAIL, _joined


def _cache(frames: int, start: float) -> torch.Tensor:
    """A key/value cache [steps, depth, 2, heads, frames, pair] whose values name their frame."""
    frame = torch.arange(frames, dtype=torch.float32) + start
    return frame[None, None, None, None, :, None].expand(2, 3, 2, 4, frames, 5).contiguous()


def _package_trim(new: torch.Tensor, old: torch.Tensor, keep: int) -> torch.Tensor:
    """What the vocoder package does: the two joined, then its estimator trim."""
    att = torch.cat([new, old], dim=4)
    if att.shape[4] > keep + KEPT_TAIL:
        att = torch.cat([att[:, :, :, :, :keep], att[:, :, :, :, -KEPT_TAIL:]], dim=4)
    return att


@pytest.mark.parametrize("n", [1, 28, 50, 99, 150])
@pytest.mark.parametrize("past", [0, 40, 100, 228, 250, 400])
@pytest.mark.parametrize("keep", [1, 50, 128, 300])
def test_a_rows_joined_keys_are_the_packages_trim_in_one_copy(n, past, keep):
    new, old = _cache(n, 1000.0), _cache(past, 0.0)
    got = _joined(new, old, keep)
    assert torch.equal(got, _package_trim(new, old, keep))
    assert got.is_contiguous() and got.data_ptr() not in (new.data_ptr(), old.data_ptr())


def test_without_a_prompt_length_the_keys_are_joined_whole():
    new, old = _cache(50, 1000.0), _cache(400, 0.0)
    assert torch.equal(_joined(new, old, None), torch.cat([new, old], dim=4))
