"""One part's tensors <-> the bytes of one safetensors file, quantizing on the way in.

A quantized tensor is stored as its packed codes under its own name and its per-block scales
under `<name>::absmax`; the manifest's `quant` entry says how to turn them back into the original.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import safetensors.torch
import torch

from .. import quant
from ..safetensors_header import parse_header
from .dtypes import TORCH_DTYPES
from .manifest import TensorRecord

ABSMAX_SUFFIX = "::absmax"


@dataclass
class EncodedPart:
    data: bytes
    records: dict[str, dict]   # tensor name -> TensorRecord fields except part/file/expert
    quantize_seconds: float


def encode_part(tensors: dict[str, torch.Tensor], compression: str | None) -> EncodedPart:
    """Serialize tensors (optionally quantized) and say where each one's bytes landed."""
    payload: dict[str, torch.Tensor] = {}
    quant_meta: dict[str, dict] = {}
    quantize_seconds = 0.0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if compression and quant.should_quantize(name, tensor, compression):
            started = time.perf_counter()
            packed = quant.quantize(tensor, compression)
            quantize_seconds += time.perf_counter() - started
            payload[name] = packed.data.contiguous()
            payload[name + ABSMAX_SUFFIX] = packed.absmax.contiguous()
            quant_meta[name] = dict(packed.meta)
        else:
            payload[name] = tensor
    data = safetensors.torch.save(payload, metadata={"format": "pt"})
    header = parse_header(data, len(data))

    def where(key: str) -> dict:
        entry = header.tensors[key]
        return {"dtype": entry.dtype, "shape": list(entry.shape),
                "offset": header.data_start + entry.begin, "length": entry.nbytes}

    records = {}
    for name in tensors:
        record = where(name)
        if name in quant_meta:
            record["quant"] = {**quant_meta[name], "absmax": where(name + ABSMAX_SUFFIX)}
        records[name] = record
    return EncodedPart(data, records, quantize_seconds)


def tensor_from_bytes(buffer: bytearray | memoryview, offset: int, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor viewing `buffer` (no copy); `offset` is relative to the buffer."""
    torch_dtype = TORCH_DTYPES[dtype]
    count = 1
    for dim in shape:
        count *= dim
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(buffer, dtype=torch_dtype, count=count, offset=offset).reshape(shape)


def decode_tensor(buffer, base: int, record: TensorRecord) -> torch.Tensor:
    """Rebuild one logical tensor from a buffer holding its file's bytes from file offset `base`."""
    stored = tensor_from_bytes(buffer, record.offset - base, record.dtype, record.shape)
    meta = record.quant
    if not meta:
        return stored
    scales = meta["absmax"]
    absmax = tensor_from_bytes(buffer, scales["offset"] - base, scales["dtype"], scales["shape"])
    return quant.dequantize(stored, absmax, meta)
