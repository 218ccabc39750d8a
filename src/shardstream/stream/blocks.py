"""Blocks that are in memory only while they run: a forward pre-hook fills a streamed block from its
source (the prefetcher, which reads the next one meanwhile) just before it runs, and a forward hook
empties it right after, so that its memory is free before the reader starts another. Used by the
whole-model runtime (`model.StreamingModel`) and by a pipeline stage larger than its device's
memory (`pipeline/streamed.py`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from torch import nn

from .loader import LoadedBlock
from .weights import Slots


def fill_block(slots: Slots, block: LoadedBlock) -> None:
    block.wait()
    slots.fill(block.params)


class StreamedBlocks:
    """Hooks on `blocks[k]` for each k in `streamed`; `source.get(k)` gives (block, seconds waited).
    `released(k, block, waited, seconds)` runs when block k is emptied (seconds: it was in place),
    `settle()` after it ran, before it is emptied (e.g. a CUDA synchronize to time it)."""

    def __init__(self, blocks: list[nn.Module], slots: list[Slots], streamed: list[int], source,
                 released: Callable[[int, LoadedBlock, float, float], None] = lambda *_: None,
                 settle: Callable[[], None] = lambda: None):
        self.streamed, self._slots, self._source = streamed, slots, source
        self._released, self._settle = released, settle
        self._active: tuple[int, LoadedBlock, float, float] | None = None
        self.hooks = []
        for k in streamed:
            self.hooks.append(blocks[k].register_forward_pre_hook(functools.partial(self._before, k)))
            self.hooks.append(blocks[k].register_forward_hook(functools.partial(self._after, k)))

    def _before(self, k: int, module, args) -> None:
        self.release()   # a pass that stopped inside a block (an exception) left it in place
        block, waited = self._source.get(k)
        fill_block(self._slots[k], block)
        self._active = (k, block, waited, time.perf_counter())

    def _after(self, k: int, module, args, output) -> None:
        self._settle()
        self.release()

    def release(self) -> None:
        """Empty the block in place, if any: its memory must be free before the reader starts the next."""
        if self._active is None:
            return
        (k, block, waited, started), self._active = self._active, None
        seconds = time.perf_counter() - started
        self._slots[k].empty()
        self._released(k, block, waited, seconds)
        block.params.clear()
        self._source.release()

    def close(self) -> None:
        """Empty the block in place, take the hooks off, stop the reader."""
        self.release()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self._source.close()
