"""Products of float32 activations with bfloat16 or float16 weights kept as stored, never copied into float32.

On a CPU without bfloat16 instructions (no AVX512_BF16 or AMX), torch's own bfloat16 product is slow, and
converting a weight into a float32 copy to multiply it doubles its bytes in memory. `linear` multiplies the
16-bit values in float32 math instead: quant_linear.cpp widens 16 of them at a time in registers (bfloat16:
a shift; float16: the F16C conversion) and multiplies them in at once, as it does 4-bit codes, through the
same tiles and the same fixed order of sums, so a row's product is the same bits alone or in any batch.
Every thread multiplies a panel of its output columns, sized for the L2 cache, by x a block of rows at a
time, and widens the values in registers at every row count: read from L2 at half the bytes, they beat a
float32 buffer of them. One row (a decode step) is bound by reading the weight from memory: each thread
reads its rows as four sequential streams, each asking for its cache lines a fixed distance ahead
(read_ahead.h), which a whole decode step needs more than a lone product does. docs/BENCHMARKS.md
("Products from bf16/fp16 weights on the CPU") has the speeds beside torch's.

Where the kernel cannot run (no AVX-512 or AVX2, no C++ compiler, or `SHARDSTREAM_HALF_KERNEL=0`), the
weight is converted `TILE_BYTES` at a time into a reused float32 buffer and multiplied by `F.linear`: the
same values, rounded within ~1e-6 of the kernel's, never a float32 copy of the whole matrix. The INFO
log says which path runs and why.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from .. import native
from ..switches import HALF_KERNEL
from . import quant_linear

log = logging.getLogger("shardstream.stream")

FORMATS = {torch.bfloat16: 1, torch.float16: 2}   # the weight dtypes the kernel reads, by its code for them
# The fallback's float32 buffer: a few cache-sized megabytes of weight rows at a time.
TILE_BYTES = 4 << 20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight.float(), bias)` for a float32 `x` (any leading dims, any strides) and a 2-D
    bfloat16 or float16 CPU `weight` (N x K, each row contiguous, rows any distance apart: a view into a
    bigger buffer does), in float32, without a float32 copy of `weight` (`supports` says what it takes)."""
    if not supports(weight, x.dtype) or x.device.type != "cpu":
        raise ValueError(f"half_linear takes a float32 CPU x and a 2-D bfloat16/float16 CPU weight with contiguous "
                         f"rows, not x {x.dtype} on {x.device} and weight {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device}")
    out_features, in_features = weight.shape
    flat = x.reshape(x.shape[:-1].numel(), in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    library = _library()
    if library is None:
        out = _tiled(flat, weight)
    else:
        out = torch.empty(flat.shape[0], out_features)
        library.half_linear(flat.data_ptr(), flat.shape[0], in_features, flat.stride(0), weight.data_ptr(),
                            weight.stride(0), out_features, out.data_ptr(), out.stride(0), FORMATS[weight.dtype])
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)


def rows(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """[len(weights), N] float32: row i of the float32 x (x's one row for every weight, where it has one) @
    weights[i].float()ᵀ, the weights bfloat16 or float16 matrices of one shape and dtype, in one call of the
    kernel (`rows_fit` says when), each row the bits `linear` gives it."""
    count, (out_features, in_features) = len(weights), weights[0].shape
    flat = x.reshape(-1, in_features).contiguous()
    out = torch.empty(count, out_features)
    pointers, strides = ctypes.c_void_p * count, ctypes.c_int64 * count
    _library().half_linear_rows(count, native.row_addresses(flat, count), in_features,
                                pointers(*(w.data_ptr() for w in weights)), strides(*(w.stride(0) for w in weights)),
                                out_features, out.data_ptr(), FORMATS[weights[0].dtype])
    return out


def rows_fit(weights: list) -> bool:
    """Whether `rows` multiplies these: `supports`' matrices, all of one shape and dtype, with the kernel built."""
    first = weights[0]
    return (isinstance(first, torch.Tensor) and supports(first, torch.float32) and _library() is not None
            and all(isinstance(w, torch.Tensor) and w.dtype == first.dtype and w.shape == first.shape
                    and supports(w, torch.float32) for w in weights))


def supports(weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
    """Whether `linear` takes `weight` with activations of `x_dtype`: float32 activations, a 2-D bfloat16 or
    float16 CPU weight whose rows are contiguous (any K; rows may lie any distance apart, not overlapping)."""
    return (x_dtype == torch.float32 and weight.dtype in FORMATS and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.stride(1) == 1 and weight.stride(0) >= weight.shape[1])


def available() -> bool:
    """Whether the native kernel is built and loaded (else `linear` converts the weight tile by tile)."""
    return _library() is not None


def _tiled(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fallback: `TILE_BYTES` of weight rows at a time widened into one reused float32 buffer."""
    out_features, in_features = weight.shape
    out = torch.empty(flat.shape[0], out_features)
    rows = max(1, min(out_features, TILE_BYTES // (4 * max(in_features, 1))))
    buffer = torch.empty(rows, in_features)
    for start in range(0, out_features, rows):
        tile = buffer[:min(rows, out_features - start)]
        tile.copy_(weight[start:start + len(tile)])
        out[:, start:start + len(tile)] = F.linear(flat, tile)
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    without = ("bfloat16/float16 weights are converted to float32 a few MB at a time for each product "
               "(slower than the kernel, no bigger in memory)")
    library = quant_linear.load_library("half-precision weight kernel", HALF_KERNEL, without)
    if library is not None:
        log.info("half-precision weight kernel: on (%s build): bfloat16/float16 weights are multiplied as stored",
                 torch.backends.cpu.get_cpu_capability())
    return library
