"""The writing half of a conversion: parts encoded and written on worker threads.

Reads, writes and fsyncs overlap because the shard loop hands each finished part (or piece) to
this pipeline and reads on; at most WRITERS parts are in flight. A part's pieces are recorded
before the write that completes it, and a source shard is released only once every write that
came from it has finished, so a kill never loses data.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from .store import StoreWriter
from .store.span import FileSpan

log = logging.getLogger("shardstream.convert")


@dataclass
class PartProfile:
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    quantize_seconds: float = 0.0
    write_seconds: float = 0.0
    bytes_written: int = 0


class WritePipeline:
    """Writer threads plus a release thread; use as a context manager (it waits for both)."""

    WRITERS = 2

    def __init__(self, writer: StoreWriter, expert_of: dict[str, int], shard_of: dict[str, str]):
        self.writer = writer
        self.expert_of = expert_of
        self.shard_of = shard_of
        self.pending: deque[Future] = deque()
        self.piece_writes: dict[str, list[Future]] = {}
        self.releases: list[Future] = []
        self.stats_lock = threading.Lock()
        self.written: list[str] = []
        self.bytes_written = 0
        self.profile: dict[str, PartProfile] = defaultdict(PartProfile)

    def __enter__(self) -> "WritePipeline":
        self._stack = ExitStack()
        self.pool = self._stack.enter_context(
            ThreadPoolExecutor(max_workers=self.WRITERS, thread_name_prefix="shardstream-writer"))
        self.releaser = self._stack.enter_context(
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardstream-release"))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._stack:
            if exc_type is None:
                self.wait_for_releases()

    def submit(self, part: str, tensors: dict[str, torch.Tensor | FileSpan], piece: int | None, complete: bool) -> None:
        if complete:
            for earlier in self.piece_writes.pop(part, []):
                earlier.result()   # the part's pieces are recorded before the write that completes it
        while len(self.pending) >= self.WRITERS:
            self.pending.popleft().result()
        future = self.pool.submit(self._write, part, tensors, piece, complete)
        self.pending.append(future)
        if not complete:
            self.piece_writes.setdefault(part, []).append(future)

    def release_when_written(self, shard: str, release: Callable[[str], None], wait: bool) -> None:
        """Release a processed shard once every write taken from it is durable.

        A download must go before the next one arrives (peak disk: one shard), so remote sources
        wait here (`wait`); a local shard is already on disk, so its deletion waits on the release
        thread while the next shard is read.
        """
        writes = list(self.pending)
        if wait:
            self.drain()
            self._release(shard, [], release)
        else:
            self.releases.append(self.releaser.submit(self._release, shard, writes, release))

    def wait_for_releases(self) -> None:
        """Until every shard handed to `release_when_written` so far is released (deleted)."""
        for release in self.releases:
            release.result()

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def _release(self, shard: str, writes: list[Future], release: Callable[[str], None]) -> None:
        for write in writes:
            write.result()   # a failed write keeps the shard: the error surfaces in the loop
        self.writer.sync()   # what came from the shard is durable before the shard goes
        release(shard)
        log.info("released shard %s", shard)

    def _write(self, part: str, tensors: dict[str, torch.Tensor | FileSpan], piece: int | None, complete: bool) -> None:
        """Runs on a writer thread; StoreWriter serialises the manifest updates."""
        experts = {n: self.expert_of[n] for n in tensors if n in self.expert_of}
        shards = sorted({self.shard_of[n] for n in tensors})
        timings = self.writer.write(part, tensors, experts, piece, complete, shards)
        with self.stats_lock:
            profile = self.profile[part]
            profile.read_seconds += timings.read_seconds
            profile.quantize_seconds += timings.quantize_seconds
            profile.write_seconds += timings.write_seconds
            profile.bytes_written += timings.nbytes
            self.bytes_written += timings.nbytes
            if complete:
                self.written.append(part)
        if complete:
            log.info("wrote part %s", part)
        else:
            log.info("wrote piece %d of part %s", piece, part)
