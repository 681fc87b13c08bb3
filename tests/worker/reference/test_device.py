"""The reference engine's device choice: checked before any weights load."""

from __future__ import annotations

import pytest
import torch

from omnifabric.worker.engines.reference.engine import ReferenceEngine, check_device
from omnifabric.worker.engines.reference.llm import ReplyModel

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@needs_no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_clear_error(device):
    with pytest.raises(ValueError) as err:
        ReferenceEngine(device=device)
    assert str(err.value) == (f"device {device!r} requested but torch.cuda.is_available() is False")


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", ""])
def test_other_devices_are_refused(device):
    with pytest.raises(ValueError, match="device"):
        check_device(device)


def test_cuda_vanishing_before_load_is_caught(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    engine = ReferenceEngine(device="cuda:0")
    assert engine.device == "cuda:0" and engine.concurrency == 1  # one GPU, one engine thread
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        check_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="is_available"):
        engine.load()


def test_cpu_always_works():
    engine = ReferenceEngine(device="cpu")
    assert engine.device == "cpu" and engine.concurrency >= 1
    assert check_device("cpu") == torch.device("cpu")


def test_reply_model_on_its_device():
    model = ReplyModel(device="cpu")
    assert model.device == torch.device("cpu") and model.model.device.type == "cpu"
    conversation = model.conversation("Be brief.")
    conversation.add_user_turn("Say hi.")
    text, _ = conversation.next_tokens(3)
    assert text
