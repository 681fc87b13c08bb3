"""tools/vocoder_bench's TF32 emulation (what `--deviation` runs on a CPU): operands rounded
as a tensor core reads float32 in TF32 (10 explicit mantissa bits, to nearest even)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from omnifabric.tools.vocoder_bench import _tf32, emulated  # noqa: E402

ULP = 2.0**-10  # TF32's step at 1.0


@pytest.mark.parametrize(
    "value, rounded",
    [
        (1.0 + ULP, 1.0 + ULP),  # representable: kept
        (1.0 + ULP / 2, 1.0),  # a tie: to the even neighbour
        (1.0 + 3 * ULP / 2, 1.0 + 2 * ULP),  # a tie: to the even neighbour, up
        (1.0 + ULP / 2 + 2.0**-20, 1.0 + ULP),  # past the tie: up
        (1.0 + ULP / 2 - 2.0**-20, 1.0),  # short of it: down
        (-(1.0 + 3 * ULP / 2), -(1.0 + 2 * ULP)),  # the sign kept
        (float("inf"), float("inf")),
    ],
)
def test_a_value_rounds_as_tf32_reads_it(value: float, rounded: float) -> None:
    got = _tf32(torch.tensor([value], dtype=torch.float32))
    assert got.item() == rounded


def test_other_dtypes_and_non_tensors_pass_unchanged() -> None:
    doubles = torch.tensor([1.0 + 2.0**-30], dtype=torch.float64)
    assert _tf32(doubles) is doubles and _tf32(3) == 3


def test_products_in_the_emulation_take_rounded_operands() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    with emulated("tf32"):
        got = torch.nn.functional.linear(x, w)
        same = x @ w.T
    want = torch.nn.functional.linear(_tf32(x), _tf32(w))
    assert torch.equal(got, want) and torch.equal(same, want)
    assert not torch.equal(want, torch.nn.functional.linear(x, w))  # the rounding shows


def test_float16_products_round_operands_and_result() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    with emulated("float16"):
        got = torch.nn.functional.linear(x, w)
    want = torch.nn.functional.linear(x.half().float(), w.half().float()).half().float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(ValueError, match="no emulation of 'int8'"):
        emulated("int8")
