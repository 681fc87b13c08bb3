"""Faster fp32 linear layers on the CPU for the reference engine's torch models.

On this project's 2-core machine (AMD EPYC), torch's CPU ``nn.Linear`` goes through MKL's sgemm
at about half the speed of oneDNN's fp32 kernel -- the one torch.compile's CPU backend emits
(``torch.ops.mkldnn._linear_pointwise``). Routing the recognizers' linear layers through it
took Whisper base from 252 to 159 ms per question and Moonshine base-en from 149 to ~108 ms
(one thread, medians over the same utterances, identical transcripts).

The op is torch-internal, so it is used only where it exists, on CPU fp32 weights, and after a
check at load that it gives the stock layer's result (else the stock layer stays).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

TOLERANCE = 1e-4
"""Largest difference from the stock layer accepted (relative to the output's scale)."""


def _kernel() -> Any:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


def use_onednn(model: nn.Module) -> int:
    """Route ``model``'s CPU fp32 ``nn.Linear`` layers through oneDNN; how many were.

    A layer keeps its weights (the same tensors, so tied weights stay tied); only its forward
    changes. Nothing changes when the kernel is missing or disagrees with the stock layer.
    """
    kernel = _kernel()
    linears = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]
    if kernel is None or not linears:
        return 0
    probe = linears[0]
    with torch.inference_mode():
        x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0))
        try:
            fast = kernel(x, probe.weight, probe.bias, "none", [], "")
        except RuntimeError as exc:
            log.info("oneDNN linear kernel unusable (%s): stock linear layers kept", exc)
            return 0
        stock = probe(x)
        if not torch.allclose(fast, stock, atol=TOLERANCE * float(stock.abs().max()), rtol=0):
            log.warning("oneDNN linear kernel disagrees with nn.Linear: stock layers kept")
            return 0
    for layer in linears:
        layer.forward = _forward(kernel, layer)  # type: ignore[method-assign,assignment]
    return len(linears)


def _forward(kernel: Any, layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, bias = layer.weight, layer.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = kernel(x, weight, bias, "none", [], "")
        return out

    return forward
