"""Products of float32 activations with half-precision weights held as stored (stream/half_linear.py):
equal to the product of the weights converted to float32, within float32 rounding, for every row count,
shape, bias and tiling, without converting the matrix whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardstream.stream import half_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leading", [(0,), (1,), (3,), (2, 5), (1, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_float32_product_of_the_converted_weight(monkeypatch, dtype, leading, bias):
    monkeypatch.setattr(half_linear, "TILE_BYTES", 7 * 96 * 4)   # 7 rows a tile: 37 rows are 6 tiles, the last short
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 96, generator=generator).to(dtype)
    x = torch.randn(*leading, 96, generator=generator)
    b = torch.randn(37, generator=generator) if bias else None
    got = half_linear.linear(x, weight, b)
    want = F.linear(x, weight.float(), b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_sliced_from_a_longer_input_is_multiplied_as_it_is():
    """transformers' logits_to_keep hands the head the last position of a longer input (a strided view)."""
    weight = torch.randn(50, 64).to(torch.bfloat16)
    x = torch.randn(1, 9, 64)[:, -1:, :]
    torch.testing.assert_close(half_linear.linear(x, weight, None), F.linear(x, weight.float()), rtol=1e-5, atol=1e-5)


def test_supports_half_precision_matrices_beside_float32_activations():
    assert half_linear.available()
    assert half_linear.supports(torch.empty(0, 64, dtype=torch.bfloat16), torch.float32)
    assert half_linear.supports(torch.empty(4, 64, dtype=torch.float16), torch.float32)
    assert not half_linear.supports(torch.empty(4, 64), torch.float32)                       # float32: F.linear
    assert not half_linear.supports(torch.empty(4, 64, dtype=torch.bfloat16), torch.bfloat16)
    assert not half_linear.supports(torch.empty(64, dtype=torch.bfloat16), torch.float32)
