"""A rank's share of a stored tensor, read by byte offsets from the whole part's file.

A weight is stored row-major `[out, in]`: a share of rows is one contiguous read per range; a share
of columns is one read per row (the stride is the full row). Nothing outside the share is read, and
every byte read is counted (`bytes_read`), so a test can hold a rank to its share.

A quantized weight is stored as codes blockwise over the flattened tensor (quant.py), one absmax
per block: a share whose element ranges all start and end on block boundaries is read as its codes
and scales and stays quantized (a row share, when a block does not cross rows; a column share whose
columns are a multiple of the block size). Any other share, and any share of an int4 weight (its
codes interleave 16 rows), is read whole, dequantized and sliced: the rank then holds it dequantized,
in the checkpoint's dtype (e.g. an 8-bit down_proj whose rank columns are not a multiple of 256).

The part file's checksum covers all of it and cannot be checked from a share; the rank's own files
are checksummed as they are written (rankstore.py).
"""

from __future__ import annotations

from math import prod

import torch

from .. import quant
from ..store.dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from ..store.manifest import TensorRecord
from ..store.reader import Store, read_spans
from .layout import Take

Stored = tuple[bytearray, dict]   # bytes, and their record (offsets into them): what partfile.encode_stored takes
_CODES_PER_BYTE = {"4bit": 2, "8bit": 1}


def full_shape(record: TensorRecord) -> list[int]:
    """The tensor's shape as the model uses it (a quantized one's, not its codes')."""
    return list((record.quant or {}).get("shape") or record.shape)


def element_ranges(shape: list[int], share: Take) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the flattened tensor that make up the share, in the share's order."""
    if share.dim is None:
        return [(0, prod(shape))]
    if share.dim == 0:
        inner = prod(shape[1:])
        return [(start * inner, stop * inner) for start, stop in share.ranges]
    assert share.dim == 1 and len(shape) == 2, "only a 2-D weight is split by columns"
    return [(i * shape[1] + start, i * shape[1] + stop) for i in range(shape[0]) for start, stop in share.ranges]


def share_shape(shape: list[int], share: Take) -> list[int]:
    out = list(shape)
    if share.dim is not None:
        out[share.dim] = share.size()
    return out


def on_blocks(record: TensorRecord, ranges: list[tuple[int, int]]) -> bool:
    """Whether every range starts and ends on a quantization block boundary (or at the tensor's end) of a
    flat blockwise method (int4's codes interleave 16 rows, quant_int4.py: its shares are never cut from them)."""
    if record.quant["method"] not in quant.BLOCKWISE:
        return False
    size, total = record.quant["blocksize"], prod(record.quant["shape"])
    return all(start % size == 0 and (stop % size == 0 or stop == total) for start, stop in ranges)


class ShareReader:
    """Reads shares of one store's tensors, keeping count of the bytes it read."""

    def __init__(self, store: Store):
        self.store = store
        self.bytes_read = 0

    def read(self, record: TensorRecord, share: Take) -> Stored:
        """The share's bytes and record: as stored (codes and scales for a quantized share on block
        boundaries), else dequantized and sliced; zeros where the rank holds zeros."""
        shape = full_shape(record)
        if share.zeros:
            return _dense(torch.zeros(shape, dtype=TORCH_DTYPES[record.dtype]))
        ranges = element_ranges(shape, share)
        if record.quant and on_blocks(record, ranges):
            buffer, scale_bytes = self._codes(record, ranges)
            scales = {**record.quant["absmax"], "offset": 0, "shape": [scale_bytes // _scale_item(record)]}
            quantized = {**record.quant, "shape": share_shape(shape, share), "absmax": scales}
            return buffer, {"offset": scale_bytes, "dtype": record.dtype, "shape": [len(buffer) - scale_bytes],
                            "quant": quantized}
        if record.quant:   # the share cuts through blocks: the whole tensor's codes, dequantized, then sliced
            buffer, scale_bytes = self._stored(record)
            scales = torch.frombuffer(buffer, dtype=TORCH_DTYPES[record.quant["absmax"]["dtype"]],
                                      count=scale_bytes // _scale_item(record))
            codes = torch.frombuffer(buffer, dtype=torch.uint8, offset=scale_bytes, count=len(buffer) - scale_bytes)
            return _dense(_slice(quant.dequantize(codes, scales, record.quant).view(shape), share))
        item = TORCH_DTYPES[record.dtype].itemsize
        buffer = bytearray(sum(stop - start for start, stop in ranges) * item)
        self._read(record, [(record.offset + start * item, (stop - start) * item) for start, stop in ranges], buffer)
        return buffer, {"offset": 0, "dtype": record.dtype, "shape": share_shape(shape, share)}

    def _codes(self, record: TensorRecord, ranges: list[tuple[int, int]]) -> tuple[bytearray, int]:
        """The scales, then the codes, of these element ranges (on block boundaries) in one buffer (the
        scales first: aligned at 0 for their dtype); and the scales' length in bytes."""
        meta = record.quant
        per, size, item = _CODES_PER_BYTE[meta["method"]], meta["blocksize"], _scale_item(record)
        scale_spans = [(meta["absmax"]["offset"] + start // size * item, (-(-stop // size) - start // size) * item)
                       for start, stop in ranges]
        code_spans = [(record.offset + start // per, -(-stop // per) - start // per) for start, stop in ranges]
        scale_bytes = sum(n for _, n in scale_spans)
        buffer = bytearray(scale_bytes + sum(n for _, n in code_spans))
        view = memoryview(buffer)
        self._read(record, scale_spans, view[:scale_bytes])
        self._read(record, code_spans, view[scale_bytes:])
        return buffer, scale_bytes

    def _stored(self, record: TensorRecord) -> tuple[bytearray, int]:
        """All of a quantized tensor's scales, then its codes, in one buffer; and the scales' length in bytes."""
        scales = record.quant["absmax"]
        buffer = bytearray(scales["length"] + record.length)
        view = memoryview(buffer)
        self._read(record, [(scales["offset"], scales["length"])], view[:scales["length"]])
        self._read(record, [(record.offset, record.length)], view[scales["length"]:])
        return buffer, scales["length"]

    def _read(self, record: TensorRecord, spans: list[tuple[int, int]], into: bytearray | memoryview) -> None:
        read_spans(self.store.file_path(record.file), spans, memoryview(into))
        self.bytes_read += sum(length for _, length in spans)


def _scale_item(record: TensorRecord) -> int:
    return TORCH_DTYPES[record.quant["absmax"]["dtype"]].itemsize


def _slice(tensor: torch.Tensor, share: Take) -> torch.Tensor:
    if share.dim is None:
        return tensor
    return torch.cat([tensor.narrow(share.dim, start, stop - start) for start, stop in share.ranges], share.dim)


def _dense(tensor: torch.Tensor) -> Stored:
    tensor = tensor.contiguous()
    buffer = bytearray(tensor.view(-1).view(torch.uint8).numpy().tobytes()) if tensor.numel() else bytearray()
    return buffer, {"offset": 0, "dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape)}
