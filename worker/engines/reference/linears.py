"""Faster fp32 linear layers on the CPU for the reference engine's torch models.

On this project's 2-core machine (AMD EPYC), torch's CPU ``nn.Linear`` goes through MKL's sgemm
at about half the speed of oneDNN's fp32 kernel -- the one torch.compile's CPU backend emits
(``torch.ops.mkldnn._linear_pointwise``). Routing the recognizers' linear layers through it
took Whisper base from 252 to 159 ms per question and Moonshine base-en from 149 to ~108 ms
(one thread, medians over the same utterances, identical transcripts).

The op is torch-internal, so it is used only where it exists, on CPU fp32 weights, and after a
check at load that it gives the stock layer's result (else the stock layer stays).

Where the CPU computes bfloat16 dot products natively (AVX512-BF16 or AMX: ``native_bf16``),
the same kernel takes bfloat16 copies of a layer's weights and its input in bfloat16, summing
in fp32 (``use_onednn(..., bf16=True)``). The recognizers use it for their encoders: on this
project's 2-core machine Whisper base's encoder went from 154 to 99 ms on a 3 s window and
Moonshine base-en's from 63 to 46 ms (one thread each). Their decoders stay fp32: the
probabilities that gate silence, read drafts and pick between the two transcripts come from
them (in bfloat16 a draft's one pass and token-by-token decoding summed to log-probabilities
up to 5e-3 apart), and they gained less. The evaluation of both: docs/performance.md.
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
BF16_TOLERANCE = 3e-2
"""The same for bfloat16 layers (8 bits of mantissa: ~0.4 % a product, fp32 sums)."""


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (AVX512-BF16 or AMX tiles).
    Elsewhere oneDNN converts every operand and bfloat16 is no faster than fp32."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(cpu, probe, None)
        try:
            if check is not None and check():
                return True
        except RuntimeError:
            continue
    return False


def wants_bf16(precision: str, device: torch.device) -> bool:
    """Whether the recognizers' bfloat16 layers are used: ``precision`` "auto" (the worker's
    ``--asr-precision``) on a CPU that computes bfloat16 natively; "fp32" never."""
    return precision == "auto" and device.type == "cpu" and native_bf16()


def _kernel() -> Any:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


def use_onednn(model: nn.Module, bf16: bool = False) -> int:
    """Route ``model``'s CPU fp32 ``nn.Linear`` layers through oneDNN; how many were.

    A layer keeps its weights (the same tensors, so tied weights stay tied); only its forward
    changes. Nothing changes when the kernel is missing or disagrees with the stock layer.
    ``bf16``: the layers compute in bfloat16 (their fp32 input and output kept, the weights
    copied to bfloat16 once) where the CPU does so natively (``native_bf16``) and the kernel
    agrees with the stock layer within ``BF16_TOLERANCE``; else in fp32 as without it.
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
        stock = nn.functional.linear(x, probe.weight, probe.bias)
        if not _agrees(fast, stock, TOLERANCE):
            log.warning("oneDNN linear kernel disagrees with nn.Linear: stock layers kept")
            return 0
        half = bf16 and native_bf16() and _bf16_agrees(kernel, probe, x, stock)
    make = _forward_bf16 if half else _forward
    for layer in linears:
        layer.forward = make(kernel, layer)  # type: ignore[method-assign,assignment]
    return len(linears)


def _bf16_agrees(kernel: Any, probe: nn.Linear, x: torch.Tensor, stock: torch.Tensor) -> bool:
    try:
        out = _forward_bf16(kernel, probe)(x)
    except RuntimeError as exc:
        log.info("oneDNN bfloat16 linear kernel unusable (%s): fp32 layers kept", exc)
        return False
    if not _agrees(out, stock):
        log.warning("oneDNN bfloat16 linear kernel disagrees with nn.Linear: fp32 layers kept")
        return False
    return True


def _agrees(out: torch.Tensor, stock: torch.Tensor, tolerance: float = BF16_TOLERANCE) -> bool:
    return torch.allclose(out, stock, atol=tolerance * float(stock.abs().max()), rtol=0)


def _forward(kernel: Any, layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, bias = layer.weight, layer.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = kernel(x, weight, bias, "none", [], "")
        return out

    return forward


def _forward_bf16(kernel: Any, layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight = layer.weight.detach().to(torch.bfloat16)
    bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = kernel(x.to(torch.bfloat16), weight, bias, "none", [], "")
        return out.to(x.dtype)

    forward.bfloat16 = True  # type: ignore[attr-defined]
    return forward


def in_bf16(model: nn.Module) -> bool:
    """Whether ``model``'s linear layers compute in bfloat16 (``use_onednn(..., bf16=True)``
    took)."""
    return any(
        getattr(m.forward, "bfloat16", False) for m in model.modules() if isinstance(m, nn.Linear)
    )
