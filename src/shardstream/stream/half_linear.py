"""Products of float32 activations with bfloat16 or float16 weights held as stored, in float32 math.

A CPU without bfloat16 instructions (AVX512_BF16, AMX) multiplies bfloat16 slowly, so a half-precision
checkpoint is computed in float32 there (compute_dtype.py); converting its weights into float32 copies
would double them in memory. Instead the weights stay as stored and each product converts a tile of a
few MB of rows at a time into one reused float32 buffer, then multiplies it: the matrix is never
converted whole. The result equals `F.linear(x, weight.float(), bias)` within float32 rounding.
"""

from __future__ import annotations

import threading

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
TILE_BYTES = 4 << 20   # of float32 weights converted at once: fits a core's share of the cache, small beside a piece

_buffers = threading.local()   # each computing thread's float32 tile


def available() -> bool:
    """Whether products from half-precision weights run here (pure torch: everywhere)."""
    return True


def supports(weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
    """Whether `linear` multiplies activations of `x_dtype` by `weight` (a matrix as stored)."""
    return (weight.dtype in HALF_DTYPES and weight.dim() == 2 and weight.device.type == "cpu"
            and x_dtype == torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight.float(), bias)` for float32 `x` (any leading dims) and a 2-D half-precision CPU
    `weight`, computed as W @ xᵀ a tile of rows at a time (each output row is one tile row's dot products)."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features)
    out = torch.empty(out_features, flat.shape[0], dtype=torch.float32)
    tile_rows = max(1, TILE_BYTES // (4 * max(in_features, 1)))
    tile = _tile(tile_rows * in_features)
    for begin in range(0, out_features, tile_rows):
        end = min(begin + tile_rows, out_features)
        converted = tile[:(end - begin) * in_features].view(end - begin, in_features)
        converted.copy_(weight[begin:end])
        torch.mm(converted, flat.t(), out=out[begin:end])
    result = out.t()
    if bias is not None:
        result = result + bias
    return result.contiguous().view(*x.shape[:-1], out_features)


def _tile(elements: int) -> torch.Tensor:
    """This thread's float32 buffer of at least `elements`, reused product after product."""
    tile = getattr(_buffers, "tile", None)
    if tile is None or tile.numel() < elements:
        tile = _buffers.tile = torch.empty(elements, dtype=torch.float32)
    return tile
