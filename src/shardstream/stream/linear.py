"""Linear layers for a few rows at a time on CPU: the same product, computed as W @ xᵀ.

A batch's decode step multiplies every weight matrix by a handful of rows (one per sequence, or the
k + 1 tokens a speculative pass checks). MKL's sgemm for `x @ Wᵀ` with a few rows repacks
the whole weight matrix on every call; `W @ xᵀ` streams it once. From a few hundred rows on it
gains nothing, so larger products (a prefill) keep `F.linear` (docs/BENCHMARKS.md, section
"Many tokens per weight read"). One row is a matrix-vector product either way and keeps `F.linear`.
The sums are the same dot products: equal bit for bit from a few rows on, within rounding below, as a
batch already differs from a row alone.

A quantized weight kept packed (quant_linear.py) is multiplied from its codes instead, at every row count,
and a packed embedding dequantizes just the rows of a pass's tokens (a 4-bit 128k-token vocabulary: 131 MB
of codes in memory instead of a 525 MB bf16 matrix). Likewise a bfloat16 or float16 weight of a model
computing in float32 is held as stored (`packed` is then a plain tensor of that dtype) and multiplied in
float32 by half_linear.py, and a packed half-precision embedding converts just the rows of a pass's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import quant
from . import half_linear, quant_linear

# Row counts whose products run as W @ xᵀ: where it beats MKL's x @ Wᵀ (docs/BENCHMARKS.md, section "Many
# tokens per weight read").
FEW_ROWS = range(2, 129)


class FewRowsLinear(nn.Linear):
    """`nn.Linear` whose float32 CPU products of 2-128 rows run as W @ xᵀ (see the module docstring), or
    from `packed` while its block is in place (`weight` stays on meta): a quantized store's codes, or a
    half-precision weight held as stored in a float32 model."""

    packed: quant.QuantizedTensor | torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.packed, quant.QuantizedTensor):
            return quant_linear.linear(x, self.packed, self.bias)
        if self.packed is not None:
            return half_linear.linear(x, self.packed, self.bias)
        weight = self.weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows not in FEW_ROWS or weight.dtype != torch.float32 or x.dtype != torch.float32 or weight.device.type != "cpu":
            return flat_linear(x, weight, self.bias)
        flat = x.reshape(rows, x.shape[-1]).t()
        out = torch.mm(weight, flat) if self.bias is None else torch.addmm(self.bias.unsqueeze(1), weight, flat)
        return out.t().contiguous().view(*x.shape[:-1], weight.shape[0])


class PackedEmbedding(nn.Embedding):
    """`nn.Embedding` that, while `packed` holds its matrix as stored (`weight` stays on meta: quantized, or
    half precision in a float32 model), looks up the rows of the ids it is given, each distinct id decoded
    once into the model's dtype (the values decoding the whole gives)."""

    packed: quant.QuantizedTensor | torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(ids)
        distinct, inverse = torch.unique(ids, return_inverse=True)
        rows = (quant.dequantize_rows(self.packed, distinct) if isinstance(self.packed, quant.QuantizedTensor)
                else self.packed[distinct])
        return rows.to(self.weight.dtype)[inverse]


def weight_linear(x: torch.Tensor, weight: torch.Tensor | quant.QuantizedTensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """`flat_linear`, or (a streamed head's slice) the product from a quantized matrix's codes, or half_linear's
    float32 product where `weight` is a half-precision matrix held as stored beside float32 activations."""
    if isinstance(weight, quant.QuantizedTensor):
        return quant_linear.linear(x, weight, bias)
    if weight.dtype != x.dtype and half_linear.supports(weight, x.dtype):
        return half_linear.linear(x, weight, bias)
    return flat_linear(x, weight, bias)


def flat_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` over `x` flattened to 2-D. A row sliced from a longer input (transformers' logits_to_keep)
    keeps its parent's strides, and with those F.linear first copies a bf16 CPU weight whole, transposed:
    260 MiB for a 152k-token head, on every decode step. The product is the same bit for bit."""
    if x.dim() < 3 or not x.numel():
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def use_streaming_layers(model: nn.Module) -> None:
    """Turn every plain `nn.Linear` of `model` into a FewRowsLinear and every plain `nn.Embedding` into a
    PackedEmbedding (same parameters, same module tree; subclasses, such as quantized layers or a scaled
    embedding, are left alone)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowsLinear
        elif type(module) is nn.Embedding:
            module.__class__ = PackedEmbedding


def packable_weights(model: nn.Module) -> set[str]:
    """Parameter names of the FewRowsLinear and PackedEmbedding weights in a dtype quant_linear computes for
    (float32, or bfloat16 and float16 through float32): those a quantized store may hand over packed, and a
    half-precision store to a float32 model held as stored."""
    dtypes = {torch.float32, torch.bfloat16, torch.float16}
    return {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, (FewRowsLinear, PackedEmbedding)) and module.weight.dtype in dtypes}
