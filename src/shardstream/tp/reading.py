"""A rank's share of a stored tensor, read by byte offsets from the whole part's file.

A weight is stored row-major `[out, in]`: a share of rows is one contiguous read per range; a share
of columns is one read per row (the stride is the full row). Nothing outside the share is read, and
every byte read is counted (`bytes_read`), so a test can hold a rank to its share. The part file's
checksum covers all of it and cannot be checked from a share; exported slices
(`shardstream shard --tp`) are checked, see `model.py`.
"""

from __future__ import annotations

from math import prod

import torch

from ..store.dtypes import TORCH_DTYPES
from ..store.manifest import TensorRecord
from ..store.reader import Store, read_spans
from .layout import Take


class ShareReader:
    """Reads shares of one store's tensors, keeping count of the bytes it read."""

    def __init__(self, store: Store):
        self.store = store
        self.bytes_read = 0

    def read(self, record: TensorRecord, share: Take) -> torch.Tensor:
        dtype = TORCH_DTYPES[record.dtype]
        shape = list(record.shape)
        if share.zeros:
            return torch.zeros(shape, dtype=dtype)
        item = dtype.itemsize
        if share.dim is None:
            spans = [(record.offset, record.length)]
        elif share.dim == 0:
            row = prod(shape[1:]) * item
            spans = [(record.offset + start * row, (stop - start) * row) for start, stop in share.ranges]
            shape[0] = share.size()
        else:
            assert share.dim == 1 and len(shape) == 2, "only a 2-D weight is split by columns"
            row = shape[1] * item
            spans = [(record.offset + i * row + start * item, (stop - start) * item)
                     for i in range(shape[0]) for start, stop in share.ranges]
            shape[1] = share.size()
        out = torch.empty(shape, dtype=dtype)
        self._read_spans(record, spans, memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b""))
        return out

    def _read_spans(self, record: TensorRecord, spans: list[tuple[int, int]], into: memoryview) -> None:
        read_spans(self.store.file_path(record.file), spans, into)
        self.bytes_read += sum(length for _, length in spans)
