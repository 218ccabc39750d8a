"""Reading one block from the store into ready-to-use parameter tensors on the target device."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ..store import Store
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

    def cool(self) -> None:
        """The block has run: its pages are the first the kernel should reclaim (see mapped.cool)."""
        cool(self.mappings)

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
    """

    def __init__(self, store: Store, mapper: WeightMapper, device: torch.device, verify: bool,
                 experts: bool = True):
        self.store = store
        self._experts = experts   # False: experts stored apart are left out (loaded on demand)
        self.mapper = mapper
        self.device = device
        self._verify = verify
        self._verified: set[str] = set()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._collect = threading.local()  # load() gathers the mappings that read() makes

    def read(self, parts: list[str]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of these parts on the CPU (mapped files), checksum-verified on their first read."""
        tensors: dict[str, torch.Tensor] = {}
        for part in parts:
            verify = self._verify and part not in self._verified
            tensors.update(map_part(self.store, part, verify=verify, mappings=getattr(self._collect, "mappings", None),
                                   experts=self._experts))
            if verify:
                self._verified.add(part)
        return tensors

    def load(self, index: int) -> LoadedBlock:
        started = time.perf_counter()
        self._collect.mappings = mappings = []
        try:
            params = self.mapper.convert(self.read([f"mid/{index}"]))
        finally:
            self._collect.mappings = None
        block = self.to_device(index, params)
        block.mappings = mappings
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
