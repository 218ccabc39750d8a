"""A stage's blocks when they do not all fit in memory: the streaming runtime's reader, prefetcher
and residency rule (stream/loader.py, prefetch.py, residency.py) applied to a stage model.

The first blocks that fit the budget stay resident (`choose_resident`, with the blocks in flight
counted against it); each other block is filled by a forward pre-hook just before it runs, from
the prefetcher that reads the next one meanwhile, and emptied by a forward hook right after, as
`stream.model.StreamingModel` does for a whole model. The stage's forward, masks and KV caches do
not change, so streamed and in-memory stages give the same numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from ..stream.loader import LoadedBlock
from ..stream.prefetch import Prefetcher
from ..stream.residency import choose_resident
from ..stream.weights import Slots
from .planner import STREAM_DEPTH


class StreamedBlocks:
    """Blocks 0..n-1 of a stage (`load(k)` reads block k under the stage's names), kept within `budget` bytes."""

    def __init__(self, blocks: list[nn.Module], slots: list[Slots], load: Callable[[int], LoadedBlock], budget: int,
                 released: Callable[[int], None] = lambda k: None):
        self._slots, self._released = slots, released
        sizes = [s.nbytes for s in slots]
        self.resident = choose_resident(sizes, budget, (STREAM_DEPTH + 1) * max(sizes))
        for k in self.resident:
            self._fill(k, load(k))
        self.streamed = [k for k in range(len(slots)) if k not in self.resident]
        self._source = Prefetcher(load, self.streamed, STREAM_DEPTH) if self.streamed else None
        self._active: tuple[int, LoadedBlock] | None = None
        self._hooks = []
        for k in self.streamed:
            self._hooks.append(blocks[k].register_forward_pre_hook(functools.partial(self._before, k)))
            self._hooks.append(blocks[k].register_forward_hook(functools.partial(self._after, k)))

    def _fill(self, k: int, block: LoadedBlock) -> None:
        block.wait()
        self._slots[k].fill(block.params)

    def _before(self, k: int, module, args) -> None:
        self.release()   # a pass that stopped inside a block (an exception) left it in place
        block, _ = self._source.get(k)
        self._fill(k, block)
        self._active = (k, block)

    def _after(self, k: int, module, args, output) -> None:
        self.release()

    def release(self) -> None:
        """Empty the block in place, if any: its memory must be free before the reader starts the next."""
        if self._active is None:
            return
        (k, block), self._active = self._active, None
        self._slots[k].empty()
        self._released(k)
        block.params.clear()
        self._source.release()

    def close(self) -> None:
        """Stop the reader and take the hooks off."""
        self.release()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._source is not None:
            self._source.close()
