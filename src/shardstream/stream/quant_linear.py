"""Products with quantized weights straight from their codes, never dequantized into memory.

Dequantizing a store's blocks on every pass writes and reads again four or eight times their stored
bytes in float32 per token, which binds one stream by dequantization rather than by its reads.
`quant_linear.cpp` decodes 16 weights at a time in registers (a table lookup and one multiply: the
same float32 values dequantization writes) and multiplies them in at once; it is no slower than
dequantize-then-multiply at any row count, so it serves every one, prefills included
(docs/BENCHMARKS.md, section "Quantized stores"). An 8-bit code is gathered from its 256-entry table
rather than looked up in a register, which makes one row slower than the product of a float32 matrix
already in memory; 8-bit weights stay packed in resident blocks all the same, since dequantized they would
take four times their stored size in float32 (a 128k-token 8-bit head: 1 GB instead of 263 MB).

Each output is one sum in a fixed order whatever the number of rows (see the .cpp): a row's product
is the same bits alone or in any batch, and differs from dequantize-then-`F.linear` only in rounding
(about 1e-6). It is built on first use (native.py) for the widest vectors torch's CPU capability
reports: AVX-512F, else AVX2 with FMA (half as wide, and at prefill sizes slower than dequantizing and
MKL's product). Without either, without a C++ compiler, or with `SHARDSTREAM_QUANT_KERNEL=0`, weights
are dequantized on every pass and the INFO log says why.

On a CUDA GPU, a streamed block's weights stay packed where the Triton kernel of quant_triton.py runs, and
the few rows of a decode step are multiplied from the codes by it, with the same values (`uses_triton`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import quant
from .. import native
from ..switches import QUANT_KERNEL, Switch
from . import int4_linear

log = logging.getLogger("shardstream.stream")

SOURCE = Path(__file__).with_name("quant_linear.cpp")
# From this many rows on, a column group decodes its weights once into a buffer instead of once per tile
# of rows: decoding a 4-bit code is a register lookup, an 8-bit one a gather, so 8-bit buffers sooner
# (docs/BENCHMARKS.md, "Quantized stores").
BUFFER_ROWS = {"4bit": 32, "8bit": 7}
BITS = quant.CODE_BITS
ROUND = quant.KERNEL_ROUNDING
_TABLES = {method: quant.code_table(method).contiguous() for method in BITS}
# On a CUDA GPU, products of up to this many rows run the Triton kernel (quant_triton.py): a decode step, one row
# a sequence of a batch or the k + 1 a speculative pass checks. Each of its programs decodes its codes for one
# row, so its work grows with the rows while cuBLAS's product of a dequantized weight barely does: beyond them
# (a prefill) the weight is dequantized and cuBLAS multiplies it. Decode from the codes beats
# dequantizing on a GPU (docs/BENCHMARKS.md, "Streaming on a GPU"); the bound of 16 rows is the kernel's shape,
# not a measured crossover (benchmarks/stream_gpu.py times both, with SHARDSTREAM_TRITON=0 and without).
TRITON_ROWS = 16
TRITON_DTYPES = tuple(quant.DTYPES[name] for name in ROUND)   # x's dtypes the Triton kernel computes for


def linear(x: torch.Tensor, weight: quant.QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the quantized weight W that `weight` holds (`packable(weight.meta)`), in x's
    dtype: a bfloat16 or float16 x is multiplied in float32 (the products and sums of a float32 model) and
    the result rounded once, as the dtype's own product rounds its float32 sums. On a GPU, by the Triton kernel
    with the same values (`uses_triton`), else dequantized there and multiplied in x's dtype."""
    meta = weight.meta
    if meta["method"] == "int4":
        return int4_linear.linear(x, weight, bias)
    out_features, in_features = meta["shape"]
    if x.device.type != "cpu":
        if uses_triton(x.numel() // in_features, x.dtype, x.device):
            from . import quant_triton
            return quant_triton.linear(x, weight, bias)
        dense = quant.dequantize(weight.data, weight.absmax, meta).view(out_features, in_features)
        return F.linear(x, dense.to(x.dtype), bias)
    flat = x.reshape(-1, in_features).float()
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], out_features)
    _library().quant_linear(flat.data_ptr(), flat.shape[0], in_features, flat.stride(0), weight.data.data_ptr(),
                            weight.absmax.data_ptr(), out_features, meta["blocksize"],
                            _TABLES[meta["method"]].data_ptr(), out.data_ptr(), out.stride(0),
                            BUFFER_ROWS[meta["method"]], BITS[meta["method"]], ROUND[meta["dtype"]])
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], out_features)


def uses_triton(rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `linear` multiplies `rows` rows of `dtype` on `device` with the Triton kernel (quant_triton.py): on a
    CUDA GPU where it runs, for a few rows (`few_rows`); otherwise the weight is dequantized there, then F.linear."""
    if device.type != "cuda" or not few_rows(rows, dtype):
        return False
    from . import quant_triton
    return quant_triton.ready(device)


def few_rows(rows: int, dtype: torch.dtype) -> bool:
    """Whether a product on a GPU is one the Triton kernel serves: 1 to TRITON_ROWS rows of a dtype it writes."""
    return 0 < rows <= TRITON_ROWS and dtype in TRITON_DTYPES


def packable(meta: dict | None, device: torch.device = torch.device("cpu")) -> bool:
    """Whether a stored tensor can stay packed for `linear` on `device`: a 4-bit or 8-bit matrix (of a float32,
    bfloat16 or float16 tensor) whose rows are whole 16-value chunks, where a kernel runs: this module's on the
    CPU, quant_triton's on a CUDA GPU (`SHARDSTREAM_TRITON=0` switches that one off); int4: int4_linear's."""
    if meta and meta.get("method") == "int4":
        return int4_linear.packable(meta, device)
    if not meta or meta.get("method") not in BITS or meta.get("dtype") not in ROUND or len(meta.get("shape", ())) != 2:
        return False
    if meta["shape"][1] % 16 or meta["blocksize"] % 16:
        return False
    if device.type == "cpu":
        return available()
    if device.type != "cuda":
        return False
    from . import quant_triton
    return quant_triton.available(device)


def available() -> bool:
    return _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_library("quantized-weight kernel", QUANT_KERNEL,
                        "quantized weights are dequantized on every pass "
                        "(slower: docs/BENCHMARKS.md, \"Quantized stores\")")


def load_library(what: str, switch: Switch, without: str) -> ctypes.CDLL | None:
    """quant_linear.cpp built for the widest vectors torch's CPU capability reports, and loaded; None where
    `switch` is "0" in the environment or it cannot be built, after an INFO line "`what`: off (why): `without`".
    It serves this module's products and half_linear.py's, each with its own switch and log line."""
    library = native.build_vector_kernel(SOURCE, switch, log, what, without, ("-fopenmp",), ("c10", "torch_cpu"))
    if library is not None:
        i64, pointer = ctypes.c_int64, ctypes.c_void_p
        library.quant_linear.argtypes = [pointer, i64, i64, i64, pointer, pointer, i64, i64, pointer, pointer, i64,
                                         i64, i64, i64]
        library.quant_linear.restype = None
        library.half_linear.argtypes = [pointer, i64, i64, i64, pointer, i64, i64, pointer, i64, i64]
        library.half_linear.restype = None
        library.half_linear_rows.argtypes = [i64, pointer, i64, pointer, pointer, i64, pointer, i64]
        library.half_linear_rows.restype = None
    return library
