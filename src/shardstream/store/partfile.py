"""One part's tensors <-> the bytes of one safetensors file, quantizing on the way in.

A quantized tensor is stored as its packed codes under its own name and its per-block scales
under `<name>::absmax`; the manifest's `quant` entry says how to turn them back into the original.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .. import quant
from .dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from .manifest import TensorRecord
from .span import FileSpan

ABSMAX_SUFFIX = "::absmax"
STREAM_BYTES = 1 << 20   # spans are copied through this much memory: stays in cache, no page faults


@dataclass
class EncodedPart:
    """A safetensors file as a list of pieces (header, then each tensor's own memory, or its span
    in a source file): writing it needs no second copy of the part in memory."""

    chunks: list[memoryview | FileSpan]
    records: dict[str, dict]   # tensor name -> TensorRecord fields except part/file/expert
    quantize_seconds: float
    read_seconds: float = 0.0   # spent reading source spans while streaming

    @property
    def size(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def stream(self, hasher) -> Iterator[memoryview]:
        """The file's bytes in order, each fed to `hasher` on the way: one pass checksums and writes.
        Spans go through one reused buffer; a yielded view is only valid until the next one."""
        buffer = None
        for chunk in self.chunks:
            if not isinstance(chunk, FileSpan):
                hasher.update(chunk)
                yield chunk
                continue
            if buffer is None:
                buffer = memoryview(bytearray(STREAM_BYTES))
            for start in range(0, chunk.nbytes, STREAM_BYTES):
                started = time.perf_counter()
                piece = chunk.read_into(buffer, start)
                self.read_seconds += time.perf_counter() - started
                hasher.update(piece)
                yield piece


def encode_part(tensors: dict[str, torch.Tensor | FileSpan], compression: str | None) -> EncodedPart:
    """Lay out tensors (optionally quantized) as a safetensors file and say where each one lands.
    Spans stay in their source file unless they are to be quantized."""
    payload: dict[str, torch.Tensor | FileSpan] = {}
    quant_meta: dict[str, dict] = {}
    quantize_seconds = 0.0
    for name in sorted(tensors):
        tensor = tensors[name]
        if isinstance(tensor, FileSpan):
            if not compression:
                payload[name] = tensor
                continue
            tensor = tensor.load()
        tensor = tensor.detach().to("cpu").contiguous()
        if compression and quant.should_quantize(name, tensor, compression):
            started = time.perf_counter()
            packed = quant.quantize(tensor, compression)
            quantize_seconds += time.perf_counter() - started
            payload[name] = packed.data.contiguous()
            payload[name + ABSMAX_SUFFIX] = packed.absmax.contiguous()
            quant_meta[name] = dict(packed.meta)
        else:
            payload[name] = tensor
    return _lay_out(payload, quant_meta, list(tensors), quantize_seconds)


def encode_stored(stored: dict[str, tuple[bytearray | memoryview, dict]]) -> EncodedPart:
    """Lay out tensors exactly as another file stores them: name -> (that file's bytes, its record
    fields). Quantized codes and scales are copied, never re-quantized, so no value changes."""
    payload: dict[str, torch.Tensor] = {}
    quant_meta: dict[str, dict] = {}
    for name, (buffer, record) in stored.items():
        payload[name] = tensor_from_bytes(buffer, record["offset"], record["dtype"], record["shape"])
        if record.get("quant"):
            scales = record["quant"]["absmax"]
            payload[name + ABSMAX_SUFFIX] = tensor_from_bytes(buffer, scales["offset"], scales["dtype"], scales["shape"])
            quant_meta[name] = {k: v for k, v in record["quant"].items() if k != "absmax"}
    return _lay_out(payload, quant_meta, list(stored), 0.0)


def _lay_out(payload: dict[str, torch.Tensor | FileSpan], quant_meta: dict[str, dict], names: list[str],
             quantize_seconds: float) -> EncodedPart:
    """The safetensors header and chunks for `payload` (codes plus `::absmax` scales for quantized names)."""
    # widest dtypes first (as safetensors does), so every tensor starts aligned to its element size
    order = sorted(payload, key=lambda k: (-payload[k].dtype.itemsize, k))
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for key in order:
        end = begin + payload[key].nbytes
        header[key] = {"dtype": SAFETENSORS_DTYPES[payload[key].dtype],
                       "shape": list(payload[key].shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text

    def where(key: str) -> dict:
        first, last = header[key]["data_offsets"]
        return {"dtype": header[key]["dtype"], "shape": header[key]["shape"],
                "offset": len(prefix) + first, "length": last - first}

    records = {}
    for name in names:
        record = where(name)
        if name in quant_meta:
            record["quant"] = {**quant_meta[name], "absmax": where(name + ABSMAX_SUFFIX)}
        records[name] = record
    chunks = [memoryview(prefix)] + [_raw_bytes(payload[key]) for key in order]
    return EncodedPart(chunks, records, quantize_seconds)


def _raw_bytes(tensor: torch.Tensor | FileSpan) -> memoryview | FileSpan:
    """The tensor's own memory as bytes, without a copy (a span stays a span)."""
    if isinstance(tensor, FileSpan):
        return tensor
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def tensor_from_bytes(buffer: bytearray | memoryview, offset: int, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor viewing `buffer` (no copy); `offset` is relative to the buffer."""
    torch_dtype = TORCH_DTYPES[dtype]
    count = 1
    for dim in shape:
        count *= dim
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(buffer, dtype=torch_dtype, count=count, offset=offset).reshape(shape)


def decode_tensor(buffer, base: int, record: TensorRecord,
                  dequantize: bool = True) -> torch.Tensor | quant.QuantizedTensor:
    """Rebuild one logical tensor from a buffer holding its file's bytes from file offset `base`; a
    quantized one as its codes and scales (viewing the buffer) when not `dequantize`."""
    stored = tensor_from_bytes(buffer, record.offset - base, record.dtype, record.shape)
    meta = record.quant
    if not meta:
        return stored
    scales = meta["absmax"]
    absmax = tensor_from_bytes(buffer, scales["offset"] - base, scales["dtype"], scales["shape"])
    return quant.dequantize(stored, absmax, meta) if dequantize else quant.QuantizedTensor(stored, absmax, meta)
