"""Reading one block from the store into ready-to-use parameter tensors on the target device."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ..store import Store
from .direct import BufferPool, DirectUnsupported, read_direct, use_direct
from .mapped import cool, map_part
from .weights import WeightMapper


@dataclass
class LoadedBlock:
    """A block's parameters, ready once `ready` (a CUDA event, or None on CPU) has fired."""

    index: int
    params: dict[str, torch.Tensor]
    read_seconds: float
    ready: torch.cuda.Event | None = None
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # pinned copies kept alive until `ready`
    mappings: list = field(default_factory=list)  # the mapped files, hinted cold when the block is released
    buffers: list = field(default_factory=list)  # O_DIRECT buffers, back to `pool` when the block is released
    pool: BufferPool | None = None

    def cool(self) -> None:
        """The block has run: its pages are the first the kernel should reclaim (see mapped.cool), its
        direct-read buffers are free for the next block."""
        cool(self.mappings)
        if self.pool is not None:
            self.pool.give(self.buffers)

    def wait(self) -> None:
        """Make the compute stream wait for the copy; the caching allocator must not reuse the memory early."""
        if self.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.ready)
        for tensor in self.params.values():
            tensor.record_stream(stream)
        self.host.clear()


class BlockLoader:
    """Store part -> converted parameters on `device`.

    Parts are mapped, not copied (see mapped.py). Checksums are verified the first time each part
    is read in this process (`verify=True`), so a corrupt store fails on the first token instead of
    giving wrong text; later reads of the same part skip the hash. On CUDA the bytes go through pinned memory and a side stream, so the copy
    overlaps the previous block's compute.

    Blocks (not the resident parts) are read with O_DIRECT into reused buffers instead when they
    cannot all stay in the page cache (see direct.py; `direct=None` asks `use_direct`); a
    filesystem that refuses O_DIRECT switches this loader back to mapping for good.
    """

    def __init__(self, store: Store, mapper: WeightMapper, device: torch.device, verify: bool,
                 experts: bool = True, direct: bool | None = None):
        self.store = store
        self.direct = use_direct(store) if direct is None else direct
        self._pool = BufferPool()
        self._experts = experts   # False: experts stored apart are left out (loaded on demand)
        self.mapper = mapper
        self.device = device
        self._verify = verify
        self._verified: set[str] = set()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._collect = threading.local()  # load() gathers the mappings that read() makes

    def read(self, parts: list[str]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of these parts on the CPU, checksum-verified on their first read: mapped
        files, or (for a block, inside `load`) pool buffers read with O_DIRECT."""
        tensors: dict[str, torch.Tensor] = {}
        direct = getattr(self._collect, "buffers", None) is not None
        for part in parts:
            verify = self._verify and part not in self._verified
            if direct and self.direct:
                try:
                    tensors.update(self._read_direct(part, verify))
                except DirectUnsupported:
                    self.direct = False
            if not (direct and self.direct):
                tensors.update(map_part(self.store, part, verify=verify, experts=self._experts,
                                        mappings=getattr(self._collect, "mappings", None)))
            if verify:
                self._verified.add(part)
        return tensors

    def _read_direct(self, part: str, verify: bool) -> dict[str, torch.Tensor]:
        taken: list = []

        def read(file_name: str) -> memoryview:
            buffer, view = read_direct(self.store, file_name, self._pool, verify)
            taken.append(buffer)
            return view

        try:
            tensors = self.store.load(part, read=read, verify=verify, experts=self._experts)
        except BaseException:
            self._pool.give(taken)
            raise
        self._collect.buffers.extend(taken)
        return tensors

    def load(self, index: int) -> LoadedBlock:
        started = time.perf_counter()
        self._collect.mappings = mappings = []
        self._collect.buffers = buffers = []
        try:
            params = self.mapper.convert(self.read([f"mid/{index}"]))
        except BaseException:
            self._pool.give(buffers)
            raise
        finally:
            self._collect.mappings = self._collect.buffers = None
        block = self.to_device(index, params)
        block.mappings, block.buffers, block.pool = mappings, buffers, self._pool
        block.read_seconds = time.perf_counter() - started
        return block

    def to_device(self, index: int, params: dict[str, torch.Tensor]) -> LoadedBlock:
        if self._copy_stream is None:
            return LoadedBlock(index, params, 0.0)
        host = {name: t.pin_memory() for name, t in params.items()}
        with torch.cuda.stream(self._copy_stream):
            moved = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return LoadedBlock(index, moved, 0.0, ready, host)
