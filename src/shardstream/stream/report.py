"""What a streaming model holds and does now, as one value (`StreamingModel.report()`): what a test, a
benchmark or a user checks without reaching into the engine's parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How the reader reads the streamed pieces ahead (blocks.StreamedBlocks): in `named_modules()` order, in the
# order the first whole pass asked, each piece when asked for, or by the computing thread (prefetch.CopyAhead)
ReadAhead = Literal["guessed order", "learned order", "on demand", "copy ahead"]

Key = tuple[int, int]   # (block, piece): blocks numbered from 0 in the model, as `resident_blocks`


@dataclass(frozen=True)
class EngineReport:
    """A snapshot: later passes change what the reader does and what is in place or kept."""

    resident_blocks: tuple[int, ...]
    block_bytes: tuple[int, ...]   # each block's bytes in memory when in place: packed weights at their packed size
    read_ahead: ReadAhead
    prefetch_depth: int | None     # pieces read ahead; None: prefetching is off
    read_order: tuple[Key, ...] | None   # the order the first whole pass asked for the pieces; None before it ends
    read_buffers: int              # read buffers made so far: with reuse, the pieces in flight, not those read
    handed_out: frozenset[Key]     # pieces the reader handed out and has not had back
    in_place: frozenset[Key]       # pieces whose weights are in the model now
    host_kept: frozenset[Key]      # on a GPU: pieces kept page-locked in host RAM, only copied on later passes
    host_kept_bytes: int
    reading: str                   # how streamed blocks are read: direct.READINGS
    packed_weights: int            # checkpoint tensors multiplied from their quantized codes
    half_precision_weights: int    # half-precision matrices held as stored, multiplied in float32 (half_linear)
    streamed_head_bytes: int       # bytes of the head read in slices every pass; 0: resident, or no big head
