"""Symmetric 4-bit integers, one bfloat16 scale per 32 values of a row, laid out for stream/int4_linear.cpp.

NF4 (quant.py) is read through a table of 16 floats, so its products run in float32. These codes are
integers: a product from them multiplies int8 activations by them in integer dot-product instructions
(AVX-512 VNNI, AVX2), four times as many multiply-adds an instruction as float32 FMAs. Like llama.cpp's
Q4_0: in each block of 32 values of a row, the value of largest magnitude m sets the scale d = m / -8,
stored as bfloat16 (float32's range: no block underflows, as a float16 scale can); each value is the
nearest integer q = round(x / d) in [-8, 7], stored as q + 8; it reads back as q * d. So m is -8 steps,
zero is exact, and a value is at most half a step from its code but on m's opposite side, where the
codes stop at 7 steps (an error of up to one step, 1/8 of the block's largest magnitude).

A tensor is a matrix of rows (all but the last dimension) by columns (the last), each row's columns
padded with zeros to whole blocks. The product reads 16 rows at once, one a vector lane, so rows go in
groups of 16 (the last group holds the rest). A group's codes are its blocks in order; a block is 4
chunks of 8 columns, each chunk 4 bytes a row, row after row; byte i of a row's chunk c holds column
8c + i in its low nibble and 8c + 4 + i in its high one. The scales follow the same order: per group,
block after block, one a row. So row n of group g (width w: 16, or the rest) has its column 32b + 8c +
4h + i in byte g*16*P/2 + b*16w + c*4w + (n % 16)*4 + i (nibble h), and its scale for block b at
g*16*B + b*w + n % 16, for P padded columns in B blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BLOCK = 32   # values a scale
GROUP = 16   # rows read side by side
_CHUNK_ELEMENTS = 1 << 20   # padded values a step: bounded temporaries on a large tensor
FEW_ROWS = 16   # rows `dequantize_rows` looks up one by one (a decode step's); more, by one gather


def rows_and_columns(shape: list[int]) -> tuple[int, int]:
    """The matrix a tensor of `shape` is stored as: every dimension but the last as rows (a vector is one row)."""
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def blocks(columns: int) -> int:
    return -(-columns // BLOCK)


def code_bytes(shape: list[int]) -> int:
    rows, columns = rows_and_columns(shape)
    return rows * blocks(columns) * BLOCK // 2


def scale_count(shape: list[int]) -> int:
    rows, columns = rows_and_columns(shape)
    return rows * blocks(columns)


def quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8) and scales (bfloat16) of a finite float tensor, in the grouped layout.
    Raises ValueError on NaN or infinite values (quant.quantize turns that into its message)."""
    rows, columns = rows_and_columns(list(tensor.shape))
    padded = blocks(columns) * BLOCK
    matrix = tensor.detach().cpu().reshape(rows, columns)
    data = torch.empty(rows * padded // 2, dtype=torch.uint8)
    scales = torch.empty(rows * blocks(columns), dtype=torch.bfloat16)
    step = _rows_a_step(padded)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        values = F.pad(matrix[start:stop].float(), (0, padded - columns)).view(stop - start, -1, BLOCK)
        if not bool(torch.isfinite(values).all()):
            raise ValueError("non-finite values")
        largest = values.gather(2, values.abs().argmax(dim=2, keepdim=True))   # signed, of largest magnitude
        scale = (largest / -8).to(torch.bfloat16)
        step_size = scale.float()
        codes = torch.where(step_size != 0, values / step_size, 0).round_().clamp_(-8, 7).add_(8).to(torch.uint8)
        data[start * padded // 2: stop * padded // 2] = _grouped(_nibble_pairs(codes))
        scales[start * blocks(columns): stop * blocks(columns)] = _grouped(scale.view(stop - start, -1, 1, 1))
    return data, scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, shape: list[int], out: torch.Tensor) -> torch.Tensor:
    """Every value, q * d in float32 then cast, into `out` (contiguous, of the tensor's dtype and numel), on the
    codes' device."""
    rows, columns = rows_and_columns(shape)
    padded = blocks(columns) * BLOCK
    matrix = out.view(rows, columns)
    step = _rows_a_step(padded)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        code = data[start * padded // 2: stop * padded // 2]
        scale = scales[start * blocks(columns): stop * blocks(columns)]
        pairs = _ungrouped(code, stop - start, 4, 4)
        matrix[start:stop] = _values(pairs, _ungrouped(scale, stop - start, 1, 1).flatten(1))[:, :columns]
    return out.view(shape)


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, shape: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (of the matrix the tensor is stored as) in float32, the values `dequantize` gives them, read
    straight from their bytes: an embedding kept packed looks up a pass's tokens."""
    total, columns = rows_and_columns(shape)
    count = blocks(columns)
    if 0 < len(rows) <= FEW_ROWS:   # a decode step's tokens: each row's bytes as a strided view of its group's
        codes, scale = zip(*(_row_view(data, scales, total, count, row) for row in rows.tolist()))
        if len(rows) == 1:
            pairs, scale = codes[0].unsqueeze(0), scale[0].unsqueeze(0)
        else:
            pairs, scale = torch.stack(codes), torch.stack(scale)
        return _values(pairs, scale)[:, :columns]
    group, lane = rows.view(-1, 1, 1, 1) // GROUP, rows.view(-1, 1, 1, 1) % GROUP
    width = torch.where(group == total // GROUP, total % GROUP, GROUP)
    block = torch.arange(count).view(1, -1, 1, 1)
    chunk, byte = torch.arange(4).view(1, 1, -1, 1), torch.arange(4).view(1, 1, 1, -1)
    at = group * GROUP * count * BLOCK // 2 + block * BLOCK // 2 * width + chunk * 4 * width + lane * 4 + byte
    scale_at = (group * GROUP * count + block * width + lane).view(len(rows), count)
    return _values(data[at], scales[scale_at])[:, :columns]


def _row_view(data: torch.Tensor, scales: torch.Tensor, total: int, count: int, row: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row`'s code bytes [blocks, 4 chunks, 4] and scales [blocks], as views: its group stores them block by
    block, chunk by chunk, a run of 4 bytes for each of its rows side by side (`_grouped`)."""
    group, lane = divmod(row, GROUP)
    width = min(GROUP, total - group * GROUP)
    start = group * GROUP * count
    codes = data[start * BLOCK // 2:(start + count * width) * BLOCK // 2].view(count, 4, width, 4)[:, :, lane]
    return codes, scales[start:start + count * width].view(count, width)[:, lane]


def _values(pairs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of float32 values (padded columns) from their code bytes [rows, blocks, 4 chunks, 4] and scales."""
    codes = torch.stack([pairs & 15, pairs >> 4], dim=3).view(pairs.shape[0], -1, BLOCK)
    values = codes.float().sub_(8).mul_(scales.float().unsqueeze(2))
    return values.view(pairs.shape[0], -1)


def _nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Codes [rows, blocks, 32] as bytes [rows, blocks, 4 chunks, 4]: column 8c + i low, 8c + 4 + i high."""
    halves = codes.view(codes.shape[0], codes.shape[1], 4, 2, 4)
    return halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)


def _grouped(per_row: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, a, b] (rows from a group's start) flattened in the grouped order: per group of 16 rows
    (the last may hold fewer), block after block, then [a, row, b]: codes as [chunk, row, byte], scales with
    a = b = 1 as one a row."""
    rows, count, a, b = per_row.shape
    full = rows // GROUP * GROUP
    head = per_row[:full].reshape(-1, GROUP, count, a, b).movedim(1, 3)
    tail = per_row[full:].movedim(0, 2)
    return torch.cat([head.reshape(-1), tail.reshape(-1)])


def _ungrouped(flat: torch.Tensor, rows: int, a: int, b: int) -> torch.Tensor:
    """`_grouped`'s inverse: the flat grouped values of `rows` rows back to [rows, blocks, a, b]."""
    full = rows // GROUP * GROUP
    count = flat.numel() // (rows * a * b) if rows else 0
    head = flat[: full * count * a * b].reshape(-1, count, a, GROUP, b).movedim(3, 1).reshape(full, count, a, b)
    tail = flat[full * count * a * b:].reshape(count, a, rows - full, b).movedim(2, 0)
    return torch.cat([head, tail])


def _rows_a_step(padded: int) -> int:
    return max(GROUP, _CHUNK_ELEMENTS // max(padded, 1) // GROUP * GROUP)
