"""Strict reading of a safetensors header, before anything touches the data.

A checkpoint shard or a store file is untrusted until its whole header checks out: header size
capped, every tensor's byte length equal to shape x dtype size, offsets contiguous from zero, and
the last offset equal to the end of the file. A truncated download fails here, by name, instead of
deep inside torch.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in the file (offsets relative to the data section)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in file order, metadata, and where the data section starts."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


class HeaderError(ValueError):
    """Raised with a description of what is wrong; callers wrap it in their own error class."""


def parse_header(prefix: bytes, file_size: int) -> Header:
    """Validate a header given the file's first bytes (8 + header length at least) and its size."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(f"file is {file_size} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if header_len > MAX_HEADER_BYTES:
        raise HeaderError(f"header claims {header_len} bytes, over the {MAX_HEADER_BYTES} cap")
    data_start = 8 + header_len
    if data_start > file_size:
        raise HeaderError(f"header claims {header_len} bytes but the file has only {file_size}")
    if len(prefix) < data_start:
        raise HeaderError("header bytes were not all read")
    try:
        raw = json.loads(prefix[8:data_start].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"header is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise HeaderError("header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    entries = []
    for name, info in raw.items():
        entries.append(_entry(name, info))
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            raise HeaderError(f"tensor {entry.name!r} starts at {entry.begin}, expected {expected}")
        expected = entry.end
    if data_start + expected != file_size:
        raise HeaderError(
            f"data ends at byte {data_start + expected} but the file has {file_size} bytes "
            "(truncated or padded)"
        )
    return Header({e.name: e for e in entries}, dict(metadata), data_start, file_size)


def _entry(name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise HeaderError(f"tensor {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise HeaderError(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise HeaderError(f"tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise HeaderError(f"tensor {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or begin < 0:
        raise HeaderError(f"tensor {name!r}: {end - begin} bytes do not match shape {shape} x {dtype}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def read_header_from(handle: BinaryIO, file_size: int) -> Header:
    """Read and validate the header from an open binary file positioned anywhere."""
    handle.seek(0)
    head = handle.read(8)
    if len(head) == 8:
        (header_len,) = struct.unpack("<Q", head)
        if header_len <= MAX_HEADER_BYTES:
            head += handle.read(header_len)
    return parse_header(head, file_size)


def read_header(path: Path) -> Header:
    """Validate the header of a safetensors file on disk."""
    path = Path(path)
    with open(path, "rb") as handle:
        return read_header_from(handle, path.stat().st_size)
