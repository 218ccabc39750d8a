"""Cut a sample stream into numbered blocks cached on disk, and serve chunks of them on demand.

A source may be far larger than memory or disk budget allows to hold at once, and a Hub stream
cannot seek. So blocks are built in order, each written once as a Parquet file, and every process
on the machine shares the cache: one builds (under a file lock), the others read.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardstream.atomic import write_bytes_atomic, write_with_atomic
from shardstream.data.readers import iter_samples, local_files
from shardstream.errors import DatasetError

DEFAULT_SAMPLES_PER_BLOCK = 100_000
DEFAULT_CHUNK_SIZE = 4000
INDEX_FORMAT = "shardstream.block_cache"

if TYPE_CHECKING:  # pyarrow loads where blocks are built or read, not for `shardstream --help`
    import pyarrow as pa


@dataclass(frozen=True)
class BlockInfo:
    index: int
    samples: int
    is_last: bool

    def chunk_count(self, chunk_size: int) -> int:
        return math.ceil(self.samples / chunk_size)


def cache_key(source: str, samples_per_block: int, text_field: str) -> str:
    """A folder name that changes whenever the blocks would: other settings or edited files."""
    files = [] if source.startswith("hf://") else [
        (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in local_files(source)
    ]
    identity = json.dumps([source, samples_per_block, text_field, files])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


class BlockManager:
    """Blocks of `samples_per_block` samples, cached under `cache_dir`; chunks of `chunk_size`."""

    def __init__(self, source: str, cache_dir: Path, samples_per_block: int = DEFAULT_SAMPLES_PER_BLOCK,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, text_field: str = "text") -> None:
        if samples_per_block < 1 or chunk_size < 1:
            raise DatasetError("samples per block and dataset chunk size must be at least 1; pass positive values.")
        self.source, self.samples_per_block, self.chunk_size, self.text_field = source, samples_per_block, chunk_size, text_field
        self.dir = Path(cache_dir) / cache_key(source, samples_per_block, text_field)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stream: Iterator[str] | None = None
        self._stream_pos = 0
        self._loaded: tuple[int, pa.Table] | None = None

    @property
    def _index_path(self) -> Path:
        return self.dir / "index.json"

    def _block_path(self, index: int) -> Path:
        return self.dir / f"block_{index:06d}.parquet"

    def _read_index(self) -> dict:
        if not self._index_path.exists():
            return {"format": INDEX_FORMAT, "version": 1, "source": self.source, "text_field": self.text_field,
                    "samples_per_block": self.samples_per_block, "blocks": [], "complete": False}
        return json.loads(self._index_path.read_text(encoding="utf-8"))

    @contextmanager
    def _lock(self):
        with open(self.dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @property
    def total_blocks(self) -> int | None:
        """The number of blocks, once the end of the stream has been reached; None before."""
        index = self._read_index()
        return len(index["blocks"]) if index["complete"] else None

    def block(self, index: int) -> BlockInfo | None:
        """Block `index`, built (with every block before it) if needed; None past the end of data."""
        state = self._read_index()
        if index >= len(state["blocks"]) and not state["complete"]:
            with self._lock():
                state = self._read_index()
                while index >= len(state["blocks"]) and not state["complete"]:
                    state = self._build_next(state)
        if index >= len(state["blocks"]):
            return None
        return BlockInfo(index, state["blocks"][index], state["complete"] and index == len(state["blocks"]) - 1)

    def _samples_from(self, position: int) -> Iterator[str]:
        """The stream at `position`, reusing this process's open stream when it is already there."""
        if self._stream is None or self._stream_pos != position:
            self._stream = itertools.islice(iter_samples(self.source, self.text_field), position, None)
            self._stream_pos = position
        return self._stream

    def _build_next(self, state: dict) -> dict:
        position = sum(state["blocks"])
        stream = self._samples_from(position)
        # One sample past the block tells whether this block is the last one.
        texts = list(itertools.islice(stream, self.samples_per_block + 1))
        more = len(texts) > self.samples_per_block
        if more:
            self._stream = itertools.chain([texts.pop()], stream)
        self._stream_pos = position + len(texts)
        if texts:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({"text": pa.array(texts, pa.string())})
            write_with_atomic(self._block_path(len(state["blocks"])), lambda tmp: pq.write_table(table, tmp))
            state["blocks"].append(len(texts))
        state["complete"] = not more
        if not state["blocks"] and state["complete"]:
            raise DatasetError(f"dataset {self.source} has no non-empty samples; check the file contents or --text-field.")
        write_bytes_atomic(self._index_path, json.dumps(state, indent=1).encode())
        return state

    def chunk(self, block: int, chunk: int) -> list[str]:
        """The samples of chunk `chunk` of block `block`; loads (and builds) the block on demand."""
        if self._loaded is None or self._loaded[0] != block:
            info = self.block(block)
            if info is None:
                raise DatasetError(f"dataset {self.source} has no block {block}; the tracker and data disagree, use a fresh --tracker.")
            import pyarrow.parquet as pq

            self._loaded = (block, pq.read_table(self._block_path(block)))
        table = self._loaded[1]
        start = chunk * self.chunk_size
        if start >= table.num_rows:
            raise DatasetError(f"block {block} of {self.source} has no chunk {chunk}; the tracker and data disagree, use a fresh --tracker.")
        return table.column("text").slice(start, self.chunk_size).to_pylist()
