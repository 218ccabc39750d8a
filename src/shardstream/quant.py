"""Blockwise 4-bit (NF4) and 8-bit (dynamic map) quantization, bit-compatible with bitsandbytes; and int4.

The converter quantizes a weight once; the streaming runtime dequantizes it on every load, so
dequantization is the hot path. Where bitsandbytes is installed and its CPU kernels give the same
values as ours, dequantize uses them (several times faster); otherwise vectorized torch over
chunks of whole blocks (bounded temporary memory, no Python loop over blocks). Quantization is
ours by default (faster than bitsandbytes' CPU kernels, and the nearest code), so stored bytes
do not depend on what is installed; `_QUANTIZE_WITH_BNB` switches to bitsandbytes' kernels.
Codes, packing order and the stored absmax follow bitsandbytes, so either side can read the other's bytes.
int4 (quant_int4.py) is not theirs: 4-bit integers with a bfloat16 scale per 32 values of a row, laid out for
the CPU's integer dot products; its tensors go through the same functions here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shardstream import quant_int4
from shardstream.errors import InvalidOption, StoreCorrupt

BLOCKWISE = ("4bit", "8bit")   # bitsandbytes' flat blockwise layout, any block size
METHODS = (*BLOCKWISE, "int4")
DEFAULT_BLOCKSIZE = {"4bit": 64, "8bit": 256, "int4": quant_int4.BLOCK}  # bitsandbytes' defaults; int4's only size
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_CODES_PER_BYTE = {"4bit": 2, "8bit": 1}
CODE_BITS = {"4bit": 4, "8bit": 8, "int4": 4}
SCALE_DTYPES = {"4bit": torch.float32, "8bit": torch.float32, "int4": torch.bfloat16}
# The products from codes (stream/quant_linear.cpp on the CPU, stream/quant_triton.py on a GPU) round each decoded
# value to the stored tensor's dtype, as dequantization does; they take that dtype as this number.
KERNEL_ROUNDING = {"float32": 0, "bfloat16": 1, "float16": 2}
_CHUNK_ELEMENTS = 1 << 18  # per step: keeps temporaries small (cache-sized) on big tensors


# The 16 NF4 values exactly as bitsandbytes.functional.get_4bit_type("nf4") lists them (sorted).
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' `create_dynamic_map()` (signed, 7 exponent bits, 8 bits), in float32.

    Decade `10**(i-6)` (i = 0..6) holds the midpoints of `2**i` equal steps across [0.1, 1],
    with both signs; 0 and 1 complete the 256 values. Same float32 arithmetic as theirs, so equal.
    """
    values = [torch.tensor([0.0, 1.0])]
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (10 ** (i - 6)) * ((bounds[:-1] + bounds[1:]) / 2.0)
        values += [means, -means]
    return torch.cat(values).sort().values


_CODES = {"4bit": NF4_CODE, "8bit": dynamic_map(), "int4": torch.arange(-8.0, 8.0)}
# Decision thresholds between neighbouring codes; bucketize (ties go low) picks the nearest code.
_MIDPOINTS = {method: (code[:-1] + code[1:]) / 2 for method, code in _CODES.items()}


def code_table(method: str) -> torch.Tensor:
    """The float32 value of each code of `method` (16 for 4bit and int4, 256 for 8bit), indexed by code: a value
    is its code's times its block's scale."""
    return _CODES[_method(method)]


def _word_table(method: str) -> torch.Tensor:
    """What each 2-byte word of stored codes expands to, one row per uint16 value.

    Decoding two bytes per lookup halves the index work; 4bit packs the first code in the high
    nibble (bitsandbytes). The word's bytes are read in this machine's memory order.
    """
    word_bytes = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2)
    return _byte_values(method)[word_bytes.long()].reshape(1 << 16, -1)


def _byte_values(method: str) -> torch.Tensor:
    """The values of each byte of codes, one row per byte value (4bit: the high nibble's first)."""
    code = _CODES[method]
    return torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1) if method == "4bit" else code.unsqueeze(1)


_WORD_VALUES = {method: _word_table(method) for method in BLOCKWISE}


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantized tensor: codes, one scale per block (SCALE_DTYPES), and how to undo it (JSON-able)."""

    data: torch.Tensor  # uint8, flat; 4bit: ceil(numel/2) bytes, 8bit: numel bytes; int4: quant_int4.code_bytes
    absmax: torch.Tensor  # float32 absmax, ceil(numel / blocksize) values; int4: bfloat16 signed scales
    meta: dict  # {"method", "blocksize", "shape", "dtype"}


def held_by(tensor: torch.Tensor | QuantizedTensor) -> tuple[torch.Tensor, ...]:
    """The plain tensors holding `tensor`'s bytes: itself, or a quantized one's codes and scales."""
    return (tensor.data, tensor.absmax) if isinstance(tensor, QuantizedTensor) else (tensor,)


def should_quantize(name: str, tensor: torch.Tensor, method: str = "4bit", blocksize: int | None = None) -> bool:
    """Quantize matrices and larger; keep vectors (norms, biases), norm weights and tiny tensors exact.

    Norm scales multiply every activation, so their error costs far more than their bytes save;
    a tensor smaller than one block would spend more on its absmax than it saves.
    """
    blocksize = _blocksize(method, blocksize)
    return (
        tensor.dtype in _DTYPE_NAMES
        and tensor.ndim >= 2
        and tensor.numel() >= blocksize
        and "norm" not in name.lower()
    )


def quantize(tensor: torch.Tensor, method: str, blocksize: int | None = None) -> QuantizedTensor:
    """Quantize blockwise over the flattened tensor; the last block is zero-padded (padding not stored).

    Pure torch by default: the nearest code, the same bytes as bitsandbytes for NF4. With
    `_QUANTIZE_WITH_BNB` set, bitsandbytes' kernels quantize where they work here (checked once per
    process) and serve the block size, in the same layout; their 8-bit codes are sometimes a few
    steps from the nearest (approximate search), enough to exceed `relative_error_bound` slightly.
    """
    blocksize = _blocksize(method, blocksize)
    if tensor.dtype not in _DTYPE_NAMES:
        raise InvalidOption(
            f"tensor dtype {tensor.dtype} cannot be quantized; pass a float16, bfloat16 or float32 tensor."
        )
    meta = {"method": method, "blocksize": blocksize, "shape": list(tensor.shape), "dtype": _DTYPE_NAMES[tensor.dtype]}
    if method == "int4":
        try:
            return QuantizedTensor(*quant_int4.quantize(tensor), meta)
        except ValueError:
            raise _non_finite() from None
    flat = tensor.detach().cpu().reshape(-1)
    kernels = _bnb_kernels() if _QUANTIZE_WITH_BNB else None
    if kernels is not None and blocksize in _BNB_BLOCKSIZES and flat.numel() > 0:
        data, absmax = _bnb_quantize(kernels, flat.contiguous(), method, blocksize)
        # bitsandbytes' max skips NaN, so check the input itself.
        finite = bool(torch.isfinite(flat).all())
    else:
        data, absmax = _torch_quantize(flat, method, blocksize)  # raises on NaN / inf itself
        finite = True
    if not finite:
        raise _non_finite()
    return QuantizedTensor(data=data, absmax=absmax, meta=meta)


def _non_finite() -> InvalidOption:
    return InvalidOption("tensor holds NaN or infinite values, which blockwise codes cannot represent; keep it unquantized.")


def _torch_quantize(flat: torch.Tensor, method: str, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax in pure torch: the nearest code (ties go low) to value * (1 / block absmax).

    Per chunk of whole blocks, in reused float32/int32 buffers: the block absmax, the scaled values
    in place, then the code by `_code_lookup` (two table lookups and one compare per value).
    """
    n = flat.numel()
    per_byte = _CODES_PER_BYTE[method]
    data = torch.empty(-(-n // per_byte), dtype=torch.uint8)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    if n == 0:
        return data, absmax
    base, cell_top = _code_lookup(method)
    step = min(_chunk_elements(blocksize), -(-n // (2 * blocksize)) * 2 * blocksize)
    values = torch.empty(step, dtype=torch.float32)
    keys = torch.empty(step, dtype=torch.int32)
    cells = torch.empty(step, dtype=torch.int32)
    above = torch.empty(step, dtype=torch.bool)
    codes = torch.empty(step, dtype=torch.uint8)
    packed_buf = torch.empty(step // 2, dtype=torch.uint8)
    low = torch.empty(step // blocksize, dtype=torch.float32)
    for start in range(0, n, step):
        stop = min(start + step, n)
        m = -(-(stop - start) // blocksize) * blocksize  # whole blocks; step is a multiple of 2 blocks
        v = values[:m]
        v[: stop - start].copy_(flat[start:stop])
        v[stop - start :].zero_()
        blocks = v.view(-1, blocksize)
        nb = blocks.shape[0]
        block_max = absmax[start // blocksize : start // blocksize + nb]
        # max |x| per block as max(max x, -min x): the same value, without an |x| temporary.
        torch.amax(blocks, dim=1, out=block_max)
        torch.amin(blocks, dim=1, out=low[:nb])
        torch.maximum(block_max, low[:nb].neg_(), out=block_max)
        if not bool(torch.isfinite(block_max).all()):  # before the lookup: NaN keys index nothing
            raise _non_finite()
        scale = torch.clamp(block_max, min=1e-38).reciprocal_()
        blocks.mul_(scale.unsqueeze(1)).clamp_(-1, 1)
        # Order-preserving int32 key of each float: negative floats get their magnitude bits flipped.
        bits = v.view(torch.int32)
        k = keys[:m]
        torch.bitwise_right_shift(bits, 31, out=k)
        k.bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)
        c = cells[:m]
        torch.bitwise_right_shift(k, _KEY_SHIFT, out=c)
        c.add_(_KEY_OFFSET)
        out_codes = codes[:m]
        torch.index_select(base, 0, c, out=out_codes)
        torch.gt(k, cell_top.index_select(0, c), out=above[:m])
        out_codes.add_(above[:m])
        if per_byte == 2:  # first code of each pair in the high nibble
            pairs = out_codes.view(-1, 2)
            packed = torch.bitwise_left_shift(pairs[:, 0], 4, out=packed_buf[: m // 2]).bitwise_or_(pairs[:, 1])
            out = data[start // 2 : start // 2 + m // 2]
            out.copy_(packed[: out.numel()])
        else:
            data[start:stop].copy_(out_codes[: stop - start])
    return data, absmax


# Float keys >> _KEY_SHIFT index the lookup cells; a cell spans 2**_KEY_SHIFT consecutive floats,
# narrower than the closest two midpoints of either code table (asserted when the tables are built).
_KEY_SHIFT = 16
_KEY_OFFSET = (0x3F800000 >> _KEY_SHIFT) + 1  # keys of [-1, 1] lie in [-0x3F800000, 0x3F800000]


def _float_keys(values: torch.Tensor) -> torch.Tensor:
    bits = values.float().contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@functools.cache
def _code_lookup(method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell: the code of its lowest float, and the key of the one midpoint inside it (or int32 max).

    The nearest code (ties go low) is the number of midpoints below the value: the cell's base
    count, plus one where the value's key exceeds that of the midpoint inside its cell.
    """
    mids = _float_keys(_MIDPOINTS[method]).long()
    cells = 2 * _KEY_OFFSET + 1
    lows = (torch.arange(cells, dtype=torch.int64) - _KEY_OFFSET) << _KEY_SHIFT
    base = torch.searchsorted(mids, lows)  # midpoints strictly below each cell's lowest key
    mid_cells = (mids >> _KEY_SHIFT) + _KEY_OFFSET
    if len(torch.unique(mid_cells)) != len(mids):
        raise AssertionError("two midpoints share a lookup cell; lower _KEY_SHIFT")
    top = torch.full((cells,), torch.iinfo(torch.int32).max, dtype=torch.int64)
    top[mid_cells] = mids
    return base.to(torch.uint8), top.to(torch.int32)


def _bnb_quantize(kernels: object, flat: torch.Tensor, method: str, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax from bitsandbytes' kernels, in our layout (flat uint8, float32 absmax)."""
    if method == "4bit":
        data, absmax = kernels.quantize_4bit(flat, blocksize, "nf4", torch.uint8)
    else:
        data, absmax = kernels.quantize_blockwise(flat, _CODES["8bit"], blocksize)
    return data.view(-1), absmax.float().view(-1)


def dequantize(data: torch.Tensor, absmax: torch.Tensor, meta: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the tensor in its original shape and dtype: code value * block absmax, in float32.

    bitsandbytes' kernels serve the sizes they handle exactly (checked once per process), pure torch
    the rest; both give identical values. `out` (contiguous, the meta's dtype and size) receives the
    values instead of a new tensor: a streaming reader reuses one buffer per piece in flight, where
    fresh tensors per piece cost page faults and, through malloc's growing mmap threshold, stay
    allocated (docs/BENCHMARKS.md, section "Quantized stores").
    """
    method, blocksize, shape, dtype = _parse_meta(meta)
    n = math.prod(shape)
    if method == "int4":
        return _dequantize_int4(data, absmax, shape, dtype, out)
    per_byte = _CODES_PER_BYTE[method]
    _check_array("data", data, torch.uint8, -(-n // per_byte))
    _check_array("absmax", absmax, torch.float32, -(-n // blocksize))
    if data.device.type != "cpu" and out is None:
        return _dequantize_elementwise(data.reshape(-1), absmax.reshape(-1), method, blocksize, n).to(dtype).view(shape)
    if out is None:
        out = torch.empty(n, dtype=dtype)
    elif out.dtype != dtype or out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {n} values, got {out.dtype} {tuple(out.shape)}")
    data, absmax, flat = data.reshape(-1), absmax.reshape(-1), out.view(-1)
    library = _bnb_library()
    if library is not None and n % 2 == 0 and blocksize in _BNB_BLOCKSIZES:
        _bnb_dequantize(library, data, absmax, method, blocksize, flat)
    else:
        _torch_dequantize(data, absmax, method, blocksize, flat)
    return out.view(shape)


def _dequantize_int4(data: torch.Tensor, scales: torch.Tensor, shape: list[int], dtype: torch.dtype,
                     out: torch.Tensor | None) -> torch.Tensor:
    _check_array("data", data, torch.uint8, quant_int4.code_bytes(shape))
    _check_array("absmax", scales, SCALE_DTYPES["int4"], quant_int4.scale_count(shape))
    n = math.prod(shape)
    if out is None:
        out = torch.empty(n, dtype=dtype, device=data.device)
    elif out.dtype != dtype or out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {n} values, got {out.dtype} {tuple(out.shape)}")
    return quant_int4.dequantize(data.reshape(-1), scales.reshape(-1), shape, out)


def dequantize_rows(tensor: QuantizedTensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a quantized matrix, dequantized (the values `dequantize` gives them): an embedding kept
    packed looks up a pass's tokens without the whole matrix in memory. A row whose blocks it shares with its
    neighbours (blocksize not dividing the row) is cut from the blocks covering it."""
    method, blocksize, shape, dtype = _parse_meta(tensor.meta)
    rows = rows.reshape(-1).long()
    if method == "int4":
        return quant_int4.dequantize_rows(tensor.data.reshape(-1), tensor.absmax.reshape(-1), shape, rows).to(dtype)
    cols = shape[-1]
    per_byte = _CODES_PER_BYTE[method]
    if cols % blocksize == 0 and cols % per_byte == 0:
        data = tensor.data.view(-1, cols // per_byte).index_select(0, rows)
        absmax = tensor.absmax.view(-1, cols // blocksize).index_select(0, rows)
        return dequantize(data, absmax, {**tensor.meta, "shape": [len(rows), cols]})
    out = torch.empty(len(rows), cols, dtype=dtype)
    total = math.prod(shape)
    for i, row in enumerate(rows.tolist()):
        first, stop = row * cols // blocksize, -(-(row + 1) * cols // blocksize)
        begin, end = first * blocksize, min(stop * blocksize, total)   # the covering blocks' elements
        data = tensor.data[begin // per_byte: -(-end // per_byte)]
        values = dequantize(data, tensor.absmax[first:stop], {**tensor.meta, "shape": [end - begin]})
        out[i] = values[row * cols - begin: (row + 1) * cols - begin]
    return out


def dequantized_nbytes(meta: dict) -> int:
    """Bytes `dequantize` returns for this (checked) meta: what a caller's `out` buffer must hold."""
    _, _, shape, dtype = _parse_meta(meta)
    return math.prod(shape) * dtype.itemsize


def _torch_dequantize(data: torch.Tensor, absmax: torch.Tensor, method: str, blocksize: int, out: torch.Tensor) -> None:
    """Flat dequantized values into `out`: one table lookup per 2-byte word, then a per-block scale."""
    per_byte = _CODES_PER_BYTE[method]
    if data.storage_offset() % 2:
        data = data.clone()  # words must be 2-byte aligned
    n = out.numel()
    step = _chunk_elements(blocksize)
    for start in range(0, n, step):
        stop = min(start + step, n)
        words = data[start // per_byte : -(-stop // per_byte)]
        if words.numel() % 2:
            words = torch.cat([words, words.new_zeros(1)])
        values = _WORD_VALUES[method].index_select(0, words.view(torch.uint16).to(torch.int32)).view(-1)
        first_block = start // blocksize
        _scale_into(out[start:stop], values, absmax[first_block : -(-stop // blocksize)], blocksize)


def _dequantize_elementwise(data: torch.Tensor, absmax: torch.Tensor, method: str, blocksize: int, n: int) -> torch.Tensor:
    """The `n` float32 values of these codes in three kernels on the codes' device (a lookup of each byte's
    values, a per-block scale): how a GPU dequantizes a block copied packed (a quarter or an eighth of the
    bytes over the bus). The same float32 products as `_torch_dequantize`, so the same values."""
    values = _byte_table(method, data.device).index_select(0, data.int()).view(-1)[:n]
    full = n // blocksize * blocksize
    values[:full].view(-1, blocksize).mul_(absmax[: full // blocksize].unsqueeze(1))
    if full < n:
        values[full:].mul_(absmax[-1])
    return values


@functools.cache
def _byte_table(method: str, device: torch.device) -> torch.Tensor:
    return _byte_values(method).to(device)


def relative_error_bound(method: str, dtype: torch.dtype) -> float:
    """Worst |x - dequantize(quantize(x))| / block absmax, for any x of `dtype`.

    The nearest code is at most the largest half gap between neighbouring codes away (or, for
    values beyond the outermost code, the distance from +-1 to it: the 8-bit map stops at -0.993).
    Two float32 roundings (x/absmax, code*absmax) and the final cast to `dtype` add less than
    2 * eps(dtype). int4: one step (1/8) on the side where its codes stop at 7 steps, plus what rounding
    the step to bfloat16 (up to a relative 2**-8) moves the 7th.
    """
    if _method(method) == "int4":
        return 1 / 8 + 2**-8 + 2 * torch.finfo(dtype).eps
    code = _CODES[method]
    gap = max(float((code[1:] - code[:-1]).max()) / 2, float(code[0]) + 1, 1 - float(code[-1]))
    return gap + 2 * torch.finfo(dtype).eps


def max_abs_error_bound(tensor: torch.Tensor, method: str, blocksize: int | None = None) -> float:
    """Bound on max |tensor - dequantize(quantize(tensor))|, for the converter's read-back check.

    Every block's error is at most its absmax * relative_error_bound, so the tensor's is at most
    max|tensor| * relative_error_bound; one subnormal step of the dtype covers tiny blocks (of int4,
    float32's smallest normal: its bfloat16 scale's subnormal steps). The bound does not depend on
    the block size (only validated here).
    """
    _blocksize(method, blocksize)
    if tensor.numel() == 0:
        return 0.0
    finfo = torch.finfo(tensor.dtype)
    largest = float(tensor.detach().abs().max())
    floor = torch.finfo(torch.float32).smallest_normal if method == "int4" else finfo.smallest_normal * finfo.eps
    return largest * relative_error_bound(method, tensor.dtype) + floor


def _scale_into(out: torch.Tensor, values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> None:
    """out = values * absmax per block, in float32 then cast (as bitsandbytes does).

    Scaling the float32 temporary in place and casting in a separate copy is several times
    faster than one broadcasting multiply that casts on write.
    """
    n = out.numel()
    full = n // blocksize * blocksize
    values[:full].view(-1, blocksize).mul_(absmax[: full // blocksize].unsqueeze(1))
    if full < n:
        values[full:n].mul_(absmax[-1])
    out.copy_(values[:n])


def _chunk_elements(blocksize: int) -> int:
    """Whole blocks per step, an even count of them: 4-bit pairs and 2-byte words stay in one step."""
    return max(2, _CHUNK_ELEMENTS // blocksize // 2 * 2) * blocksize


# Off: bitsandbytes' CPU quantize is slower than `_torch_quantize`, and its 8-bit codes can exceed
# `relative_error_bound` (docs/BENCHMARKS.md, "Quantized stores").
_QUANTIZE_WITH_BNB = False

# bitsandbytes' CPU 4-bit kernel is inaccurate from blocksize 2048 (it falls back itself there).
_BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024)


@functools.cache
def _bnb_kernels() -> object | None:
    """bitsandbytes' quantize ops when installed and giving our codes on this machine, else None:
    absmax equal, NF4 codes equal, 8-bit codes within a few steps (bitsandbytes' approximate search)."""
    # bitsandbytes warns on import about a CPU matmul kernel package we never use; keep it quiet
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

        kernels = torch.ops.bitsandbytes
        probe = torch.linspace(-3, 5, 1024)
        for method in BLOCKWISE:
            blocksize = DEFAULT_BLOCKSIZE[method]
            data, absmax = _torch_quantize(probe, method, blocksize)
            bnb_data, bnb_absmax = _bnb_quantize(kernels, probe, method, blocksize)
            steps = (bnb_data.int() - data.int()).abs().max() if method == "8bit" else int(not torch.equal(bnb_data, data))
            if not torch.equal(bnb_absmax, absmax) or steps > 4:
                return None
    except Exception:  # an optional native library can fail to load in many ways; use ours then
        return None
    return kernels


@functools.cache
def _bnb_library() -> ctypes.CDLL | None:
    """bitsandbytes' native CPU library, when installed and dequantizing to our values here, else None.

    Loaded straight from the package's folder: importing bitsandbytes itself pulls in torch's
    compiler stack (seconds and memory in every process; docs/BENCHMARKS.md, section "Quantized
    stores"), where dequantizing needs only the library's CPU kernels, the same ones its CPU backend calls.
    """
    try:
        spec = importlib.util.find_spec("bitsandbytes")
        if spec is None or not spec.submodule_search_locations:
            return None
        suffix = {"darwin": ".dylib", "win32": ".dll"}.get(sys.platform, ".so")
        path = Path(next(iter(spec.submodule_search_locations))) / f"libbitsandbytes_cpu{suffix}"
        library = ctypes.CDLL(str(path))
        probe = torch.linspace(-3, 5, 1024)
        for method in BLOCKWISE:
            blocksize = DEFAULT_BLOCKSIZE[method]
            data, absmax = _torch_quantize(probe, method, blocksize)
            ours, theirs = torch.empty(probe.numel()), torch.full((probe.numel(),), torch.nan)
            _torch_dequantize(data, absmax, method, blocksize, ours)
            _bnb_dequantize(library, data, absmax, method, blocksize, theirs)
            if not torch.equal(ours, theirs):
                return None
    except Exception:  # an optional native library can fail to load in many ways; use ours then
        return None
    return library


def _bnb_dequantize(library: ctypes.CDLL, data: torch.Tensor, absmax: torch.Tensor, method: str, blocksize: int,
                    out: torch.Tensor) -> None:
    """Flat dequantized values into `out`, by bitsandbytes' CPU kernels (called as its CPU backend
    calls them; ctypes releases the GIL meanwhile, so reader threads dequantize in parallel)."""
    suffix = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[out.dtype]
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (data, absmax, out)]
    n = ctypes.c_longlong(out.numel())
    if method == "4bit":  # one row of n values; the kernel wants an even row length
        getattr(library, f"cdequantize_blockwise_cpu_nf4_{suffix}")(*pointers, ctypes.c_longlong(blocksize), ctypes.c_longlong(1), n)
    else:
        code = ctypes.c_void_p(_CODES["8bit"].data_ptr())
        getattr(library, f"cdequantize_blockwise_cpu_{suffix}")(code, *pointers, ctypes.c_longlong(blocksize), n)


def _method(method: object) -> str:
    if method not in METHODS:
        raise InvalidOption(f"quantization method must be one of {', '.join(METHODS)}, got {method!r}; pick one of those.")
    return method  # type: ignore[return-value]


def _blocksize(method: object, blocksize: object) -> int:
    """The validated block size: positive, and even for 4bit so byte pairs stay inside the tensor's codes;
    int4's is 32."""
    method = _method(method)
    if blocksize is None:
        return DEFAULT_BLOCKSIZE[method]
    if method == "int4" and blocksize != quant_int4.BLOCK:
        raise InvalidOption(f"blocksize of int4 is {quant_int4.BLOCK}, got {blocksize!r}; leave it out.")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1 or (method == "4bit" and blocksize % 2):
        raise InvalidOption(
            f"blocksize must be a positive integer (even for 4bit), got {blocksize!r}; use e.g. {DEFAULT_BLOCKSIZE[method]}."
        )
    return blocksize


def _parse_meta(meta: object) -> tuple[str, int, list[int], torch.dtype]:
    """Check every field of a stored meta dict, since it comes from a manifest on disk."""
    if not isinstance(meta, dict):
        raise StoreCorrupt(f"quantization meta must be a dict, got {type(meta).__name__}; re-convert the model.")
    for field in ("method", "blocksize", "shape", "dtype"):
        if field not in meta:
            raise StoreCorrupt(f"quantization meta lacks field {field!r}; re-convert the model.")
    method, blocksize, shape, dtype = meta["method"], meta["blocksize"], meta["shape"], meta["dtype"]
    if method not in METHODS:
        raise StoreCorrupt(f"quantization meta field 'method' is {method!r}, not one of {', '.join(METHODS)}; re-convert the model.")
    try:
        blocksize = _blocksize(method, blocksize)
    except InvalidOption as error:
        raise StoreCorrupt(f"quantization meta field 'blocksize' is invalid ({error}); re-convert the model.") from None
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise StoreCorrupt(f"quantization meta field 'shape' must be a list of non-negative integers, got {shape!r}; re-convert the model.")
    if dtype not in DTYPES:
        raise StoreCorrupt(f"quantization meta field 'dtype' is {dtype!r}, not one of {', '.join(DTYPES)}; re-convert the model.")
    return method, blocksize, list(shape), DTYPES[dtype]


def _check_array(field: str, array: object, dtype: torch.dtype, numel: int) -> None:
    if not isinstance(array, torch.Tensor) or array.dtype != dtype or array.numel() != numel:
        got = f"{array.dtype} with {array.numel()} values" if isinstance(array, torch.Tensor) else type(array).__name__
        raise StoreCorrupt(f"quantized '{field}' must be {dtype} with {numel} values for this meta, got {got}; re-convert the model.")
