"""Linear layers for a few rows (stream/linear.py): the same values as `F.linear`, W @ xᵀ only where it
is faster (2-128 float32 rows on CPU), and every plain Linear of a streaming model uses it while other
layer types are left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardstream.convert import convert
from shardstream import AutoModel
from shardstream.stream import linear
from shardstream.stream.linear import FewRowsLinear, use_streaming_layers
from tiny_models import save_checkpoint


def _layer(bias: bool, dtype: torch.dtype = torch.float32) -> FewRowsLinear:
    torch.manual_seed(0)
    layer = nn.Linear(96, 40, bias=bias).to(dtype)
    use_streaming_layers(layer)
    return layer


@pytest.fixture
def products(monkeypatch) -> list[str]:
    """Which product each call ran: 'W @ xT' (torch.mm / addmm with the weight first) or 'F.linear'."""
    seen: list[str] = []
    mm, addmm, linear_ = torch.mm, torch.addmm, F.linear

    def spy_mm(a, b):
        seen.append("W @ xT")
        return mm(a, b)

    def spy_addmm(bias, a, b):
        seen.append("W @ xT")
        return addmm(bias, a, b)

    def spy_linear(x, weight, bias=None):
        seen.append("F.linear")
        return linear_(x, weight, bias)

    monkeypatch.setattr(linear.torch, "mm", spy_mm)
    monkeypatch.setattr(linear.torch, "addmm", spy_addmm)
    monkeypatch.setattr(linear.F, "linear", spy_linear)
    return seen


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape,product", [((1, 1, 96), "F.linear"), ((2, 96), "W @ xT"), ((3, 1, 96), "W @ xT"),
                                           ((4, 8, 96), "W @ xT"), ((128, 96), "W @ xT"), ((2, 65, 96), "F.linear"),
                                           ((0, 96), "F.linear")])
def test_few_rows_give_linears_values_and_shape(products, bias, shape, product):
    layer = _layer(bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    assert products == [product]
    want = F.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    got.view(*shape[:-1], 2, 20)  # transformers reshapes projections with view(): it must be contiguous


def test_other_dtypes_keep_linear(products):
    layer = _layer(True, torch.bfloat16)
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert products[0] == "F.linear"


def test_only_plain_linears_are_turned(tmp_path):
    class Quantized(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Quantized(4, 4), nn.LayerNorm(4))
    use_streaming_layers(model)
    assert [type(m) for m in model] == [FewRowsLinear, Quantized, nn.LayerNorm]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_streaming_models_use_it(tmp_path, family):
    """Every plain Linear of a streaming model (GPT-2's Conv1D projections are not Linears and stay as
    they are; its head is one)."""
    save_checkpoint(family, tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    with AutoModel.from_pretrained(tmp_path / "store", max_resident_memory=0, progress=False) as model:
        linears = [m for m in model.model.modules() if isinstance(m, nn.Linear)]
        assert linears and all(type(m) is FewRowsLinear for m in linears)
