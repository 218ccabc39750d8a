"""A stage's blocks when they do not all fit in memory: the streaming runtime's reader, prefetcher,
residency rule and fill/empty hooks (stream/loader.py, prefetch.py, residency.py, blocks.py)
applied to a stage model.

The first blocks that fit the budget stay resident (`choose_resident`, with the blocks in flight
counted against it); each other block is filled just before it runs and emptied right after, as
`stream.model.StreamingModel` does for a whole model. The stage's forward, masks and KV caches do
not change, so streamed and in-memory stages give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..stream.blocks import StreamedBlocks, fill_block
from ..stream.loader import LoadedBlock
from ..stream.residency import choose_resident
from ..stream.weights import Slots
from .planner import STREAM_DEPTH


def stream_blocks(blocks: list[nn.Module], slots: list[Slots], load: Callable[[int], LoadedBlock],
                  stream: Callable[[int], LoadedBlock], budget: int) -> StreamedBlocks:
    """Blocks 0..n-1 of a stage, kept within `budget` bytes: `load(k)` reads block k under the stage's
    names to keep it resident, `stream(k)` to run it once (into buffers given back when it is emptied)."""
    sizes = [s.nbytes for s in slots]
    resident = choose_resident(sizes, budget, (STREAM_DEPTH + 1) * max(sizes))
    for k in resident:
        fill_block(slots[k], load(k))
    streamed = [k for k in range(len(slots)) if k not in resident]

    def whole(key: tuple[int, int]) -> LoadedBlock:
        return stream(key[0])   # a stage reads its blocks whole: one piece each

    return StreamedBlocks(blocks, slots, streamed, whole, STREAM_DEPTH, lambda *_: None)
