"""Products with int4 weights (quant_int4.py) in integer dot products on the CPU.

NF4's kernel (quant_linear.cpp) decodes each code through a table into a float32 and multiplies it by x in
float32: one fused multiply-add a weight. Here x is quantized once per product to int8, per block of 32
values (a scale each, as llama.cpp's Q8_0 does), and multiplied by the 4-bit integer codes in integer
dot-product instructions, which multiply-add four byte pairs a lane: AVX-512 VNNI's vpdpbusd, AVX-VNNI's
256-bit one, or AVX2's vpmaddubsw + vpmaddwd. The codes are stored 16 rows side by side (one a lane) so
that a block's sums need no reduction across lanes. docs/BENCHMARKS.md ("int4 on the CPU") measures it.

The product is not x @ Wᵀ of the dequantized W exactly: x's int8 rounding adds a relative error of about
0.4% of each block's largest value (docs/STREAMING.md gives what it does to a model's logits). What it
computes exactly (within float32 rounding) is F.linear(x_q, W) for x_q = x rounded per block (the .cpp says
how); each output is one fixed sequence of float32 operations, so a row gives the same bits alone or in any
batch, and every build gives the same bits. It is built on first use (native.py) for the widest integer
instructions the CPU has: `build`. Without AVX2, without a C++ compiler, or with `SHARDSTREAM_INT4_KERNEL=0`,
int4 weights are dequantized (to the checkpoint's dtype) and multiplied as a plain Linear, and the INFO log
says why; on a GPU too (quant_triton.py's kernel reads NF4 and 8-bit codes only).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import native, quant
from ..switches import INT4_KERNEL

log = logging.getLogger("shardstream.stream")

SOURCE = Path(__file__).with_name("int4_linear.cpp")
# Compiler flags of each build: AVX-512 with VNNI (16 columns a vector), AVX2 with AVX-VNNI, AVX2 alone (8).
BUILD_FLAGS = {
    "AVX512-VNNI": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"],
    "AVX2-VNNI": ["-mavx2", "-mfma", "-mavxvnni"],
    "AVX2": ["-mavx2", "-mfma"],
}
DTYPES = ("float32", "bfloat16", "float16")   # the stored tensors' dtypes whose Linears it serves


def linear(x: torch.Tensor, weight: quant.QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the int4 weight W that `weight` holds, in x's dtype: on the CPU by the kernel
    (x rounded per block to int8, then multiplied in float32 and the result rounded once to x's dtype), else
    dequantized where x is and multiplied there."""
    meta = weight.meta
    out_features, in_features = meta["shape"]
    if x.device.type != "cpu" or _library() is None:
        dense = quant.dequantize(weight.data, weight.absmax, meta).view(out_features, in_features)
        return F.linear(x, dense.to(x.dtype), bias)
    rows = x.reshape(-1, in_features).float().contiguous()
    out = torch.empty(rows.shape[0], out_features)
    _library().int4_linear(rows.data_ptr(), rows.shape[0], in_features, in_features, weight.data.data_ptr(),
                           weight.absmax.data_ptr(), out_features, out.data_ptr(), out_features)
    return (out if bias is None else out.add_(bias)).to(x.dtype).view(*x.shape[:-1], out_features)


def rows(x: torch.Tensor, weights: list[quant.QuantizedTensor]) -> torch.Tensor:
    """[len(weights), N] float32: row i of x (x's one row for every weight, where it has one) @ weights[i]ᵀ, every
    weight an N x K int4 matrix with N a multiple of 16, in one call of the kernel (`rows_fit` says when), each
    row the bits `linear` gives it."""
    count, (out_features, in_features) = len(weights), weights[0].meta["shape"]
    flat = x.reshape(-1, in_features).float().contiguous()
    out = torch.empty(count, out_features)
    pointers = ctypes.c_void_p * count
    _library().int4_linear_rows(count, native.row_addresses(flat, count), in_features,
                                pointers(*(w.data.data_ptr() for w in weights)),
                                pointers(*(w.absmax.data_ptr() for w in weights)), out_features, out.data_ptr())
    return out


def rows_fit(weights: list) -> bool:
    """Whether `rows` multiplies these: int4 matrices of one shape whose outputs are whole groups of 16, with the
    kernel built."""
    shape = weights[0].meta["shape"] if isinstance(weights[0], quant.QuantizedTensor) else None
    return (shape is not None and shape[0] % 16 == 0 and _library() is not None
            and all(isinstance(w, quant.QuantizedTensor) and w.meta["method"] == "int4" and w.meta["shape"] == shape
                    for w in weights))


def packable(meta: dict, device: torch.device) -> bool:
    """Whether an int4 tensor can stay packed for `linear` on `device`: a matrix of a dtype it serves, on the CPU
    where the kernel builds (on a GPU it is dequantized at load instead)."""
    return (device.type == "cpu" and meta.get("dtype") in DTYPES and len(meta.get("shape", ())) == 2
            and _library() is not None)


def build() -> str | None:
    """The build this CPU takes (a key of BUILD_FLAGS), from torch's CPU capability (ATEN_CPU_CAPABILITY can
    lower it) and the CPU's VNNI flags; None without AVX2."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = torch.cpu.get_capabilities()
    if capability == "AVX512" and flags.get("avx512_vnni") and flags.get("avx512_bw") and flags.get("avx512_vl"):
        return "AVX512-VNNI"
    if capability in ("AVX512", "AVX2"):
        return "AVX2-VNNI" if flags.get("avx_vnni") else "AVX2"
    return None


def available() -> bool:
    return _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    without = "int4 weights are dequantized on every pass and multiplied as plain Linears"
    if INT4_KERNEL.off():
        log.info("int4 kernel: off (%s=0): %s", INT4_KERNEL.name, without)
        return None
    chosen = build()
    if chosen is None:
        log.info("int4 kernel: off (this CPU has no AVX2: torch reports %s): %s",
                 torch.backends.cpu.get_cpu_capability(), without)
        return None
    library = native.build(SOURCE, ["-O3", *BUILD_FLAGS[chosen], "-fopenmp"], ["c10", "torch_cpu"], log, "int4 kernel", without)
    if library is not None:
        i64, pointer = ctypes.c_int64, ctypes.c_void_p
        library.int4_linear.argtypes = [pointer, i64, i64, i64, pointer, pointer, i64, pointer, i64]
        library.int4_linear.restype = None
        library.int4_linear_rows.argtypes = [i64, pointer, i64, pointer, pointer, i64, pointer]
        library.int4_linear_rows.restype = None
    return library
