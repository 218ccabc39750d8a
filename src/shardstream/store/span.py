"""A tensor still lying in its source file: written to the store by streaming it through a small
buffer (the way `cp` copies), so a conversion never holds a part in memory nor copies it twice.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CorruptShard


class SourceFile:
    """An open source shard shared by its spans, closed when the last span is gone: a deleted
    shard's space is freed as soon as nothing still has to be copied out of it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.close = weakref.finalize(self, os.close, self.fd)   # or at once, by whoever knows it is done with
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


@dataclass(frozen=True)
class FileSpan:
    """Tensor `name`: `nbytes` bytes at `offset` in `source`, of this dtype and shape."""

    source: SourceFile
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read_into(self, buffer: memoryview, start: int) -> memoryview:
        """Bytes [start, start + len(buffer)) of the tensor (fewer at its end), read into `buffer`."""
        wanted = min(len(buffer), self.nbytes - start)
        done = 0
        while done < wanted:
            got = os.preadv(self.source.fd, [buffer[done:wanted]], self.offset + start + done)
            if not got:
                raise CorruptShard(
                    f"shard {self.source.path.name} ended early inside {self.name!r}; download it again."
                )
            done += got
        return buffer[:wanted]

    def load(self) -> torch.Tensor:
        """The tensor in its own memory (for quantizing, which needs the values)."""
        raw = torch.empty(self.nbytes, dtype=torch.uint8)   # uninitialised: no zero-fill
        if self.nbytes:
            self.read_into(memoryview(raw.numpy()), 0)
            return raw.view(self.dtype).reshape(self.shape)
        return torch.empty(self.shape, dtype=self.dtype)
