"""Products with quantized weights straight from their codes on a CUDA GPU: one Triton kernel launch a Linear.

A quantized block crosses the bus as its codes. Dequantizing every tensor there (three kernels,
`quant._dequantize_elementwise`), then casting it and multiplying it by cuBLAS, binds a decode step by the
launches on the computing thread (docs/BENCHMARKS.md, section "Streaming on a GPU"). This kernel decodes the codes with their scales in registers and multiplies them in, one launch a
Linear, for the few rows of a decode step (`quant_linear.TRITON_ROWS`); a prefill's many rows are still
dequantized and multiplied by cuBLAS, where the product, not the launches, takes the time.

The values are those of `quant_linear.cpp`, which the CPU multiplies: each weight is its code's table value
times its block's absmax, one float32 product (what dequantization writes), rounded to the stored tensor's
dtype (bfloat16 by integer round-to-nearest-even as the .cpp does, float16 by the conversion); x is multiplied
in float32, the bias added in float32, and the result rounded once to x's dtype. So it equals dequantize
then `F.linear` in float32 up to the order of the float32 sums.

Each program computes one row of x against `BLOCK_N` output columns, walking K `BLOCK_K` at a time as pairs
of neighbouring weights: a 4-bit byte holds a pair (the even column in its high nibble), an 8-bit pair is two
bytes, and both weights of a pair share one absmax (the block size is a multiple of 16). Each lane sums its
products in float32; the lanes are summed at the end. The grid is (rows, column tiles), rows first: the
programs that read one tile's codes run side by side and share them through L2. No size depends on the
number of rows, so a row's result has the same bits alone or in any batch that the kernel serves.

Only `tl` operations stable since Triton 2.x (masked load/store, arange, integer and bit operations, casts,
sum). Checked in tests/test_quant_triton.py under `TRITON_INTERPRET=1` on the CPU and compiled for sm_90
(H100, H200) with triton 3.6.0 (torch 2.11's), 3.7.1 (torch 2.13's) and 3.8.0; on each GPU at its first use
(`available`) against dequantize + `F.linear`.
Without triton, on another device, or with `SHARDSTREAM_TRITON=0`, the GPU dequantizes each tensor and
cuBLAS multiplies it; the INFO log says why, once.
"""

import functools
import logging

import torch
import torch.nn.functional as F

from .. import quant
from ..switches import TRITON
from ..quant import CODE_BITS as BITS, KERNEL_ROUNDING as ROUND

try:
    import triton
    import triton.language as tl
except ImportError as error:   # an optional dependency (pyproject's `gpu` extra; torch's CUDA wheels bring it)
    triton = None
    _MISSING = str(error)

log = logging.getLogger("shardstream.stream")

METHODS = quant.BLOCKWISE   # the codes it reads: NF4's and 8-bit's flat blocks (int4 is dequantized on a GPU)
OUTPUT = {quant.DTYPES[name]: code for name, code in ROUND.items()}   # x's dtype (the output's), coded as ROUND
# 16 columns a program: a 2048-wide output is 128 programs a row, about one per SM of an H100; 256 weights of
# each column a step (128 pairs: 8 a thread of 4 warps). Chosen for that fit, not tuned by measurement.
BLOCK_N = 16
BLOCK_K = 256

if triton is not None:
    @triton.jit
    def _rounded(value, ROUND: tl.constexpr):
        """float32 values rounded to bfloat16 (ROUND 1) or float16 (2), kept in float32."""
        if ROUND == 1:   # to nearest even: add 0x7FFF plus the kept part's lowest bit, cut the low 16 bits
            bits = value.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            value = bits.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            value = value.to(tl.float16).to(tl.float32)
        return value

    # K (in_features) is a compile-time constant: a loop's bound known to the compiler (one build per K, a model
    # has two or three), and Triton's interpreter cannot loop up to a run-time scalar under numpy 2.4.
    @triton.jit
    def _product(x_ptr, codes_ptr, absmax_ptr, table_ptr, bias_ptr, out_ptr, N, x_stride, K: tl.constexpr,
                 BITS: tl.constexpr, BLOCKSIZE: tl.constexpr, ROUND: tl.constexpr, OUTPUT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for one row m and BLOCK_N columns n."""
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        half = K // 2
        first_pair = n.to(tl.int64) * half   # each column's first pair of weights, flat
        j = tl.arange(0, BLOCK_K // 2)
        x_row = x_ptr + m * x_stride
        acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + 2 * j   # the even column of each pair
            k_ok = k < K
            x_even = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + k + 1, mask=k_ok, other=0.0).to(tl.float32)
            pair = first_pair[:, None] + (k0 // 2 + j)[None, :]
            ok = n_ok[:, None] & k_ok[None, :]
            if BITS == 4:
                byte = tl.load(codes_ptr + pair, mask=ok, other=0).to(tl.int32)
                even, odd = byte >> 4, byte & 15
            else:
                even = tl.load(codes_ptr + 2 * pair, mask=ok, other=0).to(tl.int32)
                odd = tl.load(codes_ptr + 2 * pair + 1, mask=ok, other=0).to(tl.int32)
            scale = tl.load(absmax_ptr + pair // (BLOCKSIZE // 2), mask=ok, other=0.0)
            w_even = _rounded(tl.load(table_ptr + even) * scale, ROUND)
            w_odd = _rounded(tl.load(table_ptr + odd) * scale, ROUND)
            acc += x_even[None, :] * w_even + x_odd[None, :] * w_odd
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        out = out_ptr + m * N + n
        if OUTPUT == 1:   # bfloat16's bits, written through an int16 view
            tl.store(out, (_rounded(y, 1).to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=n_ok)
        elif OUTPUT == 2:
            tl.store(out, y.to(tl.float16), mask=n_ok)
        else:
            tl.store(out, y, mask=n_ok)


def linear(x: torch.Tensor, weight: quant.QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the quantized weight W that `weight` holds (`quant_linear.packable(meta)`),
    in x's dtype (float32, bfloat16 or float16), x, codes, scales and bias on one device: a CUDA GPU (or the
    CPU under TRITON_INTERPRET=1)."""
    meta = weight.meta
    if meta["method"] not in METHODS:
        raise ValueError(f"the Triton kernel reads {', '.join(METHODS)} codes, not {meta['method']}; dequantize them")
    out_features, in_features = meta["shape"]
    flat = x.reshape(-1, in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], out_features, dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        _product[(flat.shape[0], triton.cdiv(out_features, BLOCK_N))](
            flat, weight.data, weight.absmax, _table(meta["method"], x.device), out if bias is None else bias,
            out.view(torch.int16) if x.dtype == torch.bfloat16 else out, out_features, flat.stride(0), K=in_features,
            BITS=BITS[meta["method"]], BLOCKSIZE=meta["blocksize"], ROUND=ROUND[meta["dtype"]],
            OUTPUT=OUTPUT[x.dtype], HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.view(*x.shape[:-1], out_features)


def available(device: torch.device) -> bool:
    """Whether `linear` runs on `device`: a CUDA GPU, triton imports, `SHARDSTREAM_TRITON` is not 0, and the
    kernel gave the dequantized product there at its first use. The INFO log says once why not."""
    if device.type != "cuda":
        return False
    if TRITON.off():
        _off(f"{TRITON.name}=0")
        return False
    return ready(device)


@functools.cache
def ready(device: torch.device) -> bool:
    """`available` but for the switch, checked once per device (the switch is read where weights are packed)."""
    if triton is None:
        _off(f"triton does not import ({_MISSING}); `pip install shardstream[gpu]` installs it")
        return False
    if not torch.cuda.is_available():
        _off("torch sees no CUDA GPU")
        return False
    try:
        error = _check(device)
    except Exception as failed:   # no compiler, a GPU or driver this triton cannot build for: it raises many kinds
        error = f"{type(failed).__name__}: {failed}"
    if error:
        _off(f"the kernel failed its check on {device} ({error})")
    return not error


def _check(device: torch.device) -> str | None:
    """What is wrong with the kernel's product on `device`, against dequantize + `F.linear` (None: nothing)."""
    generator = torch.Generator().manual_seed(0)
    weight = quant.quantize((torch.randn(40, 96, generator=generator) * 0.05).to(torch.bfloat16), "4bit", 64)
    on_device = quant.QuantizedTensor(weight.data.to(device), weight.absmax.to(device), weight.meta)
    x, bias = torch.randn(3, 96, generator=generator), torch.randn(40, generator=generator)
    want = F.linear(x, quant.dequantize(weight.data, weight.absmax, weight.meta).float(), bias)
    got = linear(x.to(device), on_device, bias.to(device)).cpu()
    difference = (got - want).abs().max().item()
    return None if difference <= 1e-5 else f"results differ by {difference:.3g}"


@functools.cache
def _off(reason: str) -> None:
    log.info("quantized-weight kernel on the GPU: off (%s): each quantized Linear weight is dequantized on the "
             "GPU on every pass, then multiplied", reason)


@functools.cache
def _table(method: str, device: torch.device) -> torch.Tensor:
    return quant.code_table(method).to(device)
