"""Blocks that are in memory only while they run, piece by piece (see pieces.py).

A forward pre-hook on a block fills its piece 0 (the small tensors) from its source (the
prefetcher, which reads the next pieces meanwhile) just before the block runs; a pre-hook on each
big module fills that module's piece and a forward hook empties it right after, so that its memory
is free before the reader starts another; piece 0 is emptied when the block ends. A block that is
one piece is simply filled before it runs and emptied after. Used by the streaming engine
(`model.StreamingModel`), whether it runs a whole model, a tensor-parallel rank or a pipeline stage.

The reader reads pieces ahead in `named_modules()` order, the forward order of nearly every
family; but not of all (Phi-3 defines `o_proj` before `qkv_proj`), and a piece asked for out of
read order costs a whole cycle of reads. So the first complete pass also records the order it asks
in: at its first departure from the guess, the rest of that pass reads each piece when it is asked
for, and from the next pass on the prefetcher walks the recorded order.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from torch import nn

from .loader import LoadedBlock
from .pieces import Piece, whole
from .prefetch import CopyAhead, DirectLoader, Prefetcher
from .report import Key, ReadAhead
from .weights import Slots


def fill_block(slots: Slots, block: LoadedBlock) -> None:
    block.wait()
    slots.fill(block.params)


class StreamedBlocks:
    """Hooks on the pieces of each streamed block k (`pieces[k]`, default: `blocks[k]` whole);
    `load((k, i))` reads piece i of block k. `depth`: the pieces read ahead (None: none, each piece
    is read when asked for); `held`: the keys the reader does not count (pieces.held_through).
    `released(k, read, waited, seconds)` runs when block k is emptied (its pieces' read and wait
    times summed; seconds: it was in place), `settle()` after it ran, before it is emptied (e.g. a
    CUDA synchronize to time it). `copies_only()` says, once a whole pass has run, whether loading
    a piece now only queues its copy to the GPU (all kept in host RAM): then the pieces ahead are
    loaded by the computing thread itself (prefetch.CopyAhead)."""

    def __init__(self, blocks: list[nn.Module], slots: list[Slots], streamed: list[int],
                 load: Callable[[tuple[int, int]], LoadedBlock], depth: int | None,
                 released: Callable[[int, float, float, float], None] = lambda *_: None,
                 settle: Callable[[], None] = lambda: None, pieces: dict[int, list[Piece]] | None = None,
                 held: frozenset = frozenset(), copies_only: Callable[[], bool] = lambda: False):
        self.streamed, self._slots = streamed, slots
        self.pieces = pieces or {k: whole(blocks[k], slots[k].names, slots[k].nbytes) for k in streamed}
        self._load, self._depth, self._held_keys = load, depth, held
        self._guess = [(k, i) for k in streamed for i in range(len(self.pieces[k]))]
        self._source: DirectLoader | Prefetcher = (DirectLoader(load) if depth is None or not streamed
                                                   else Prefetcher(load, self._guess, depth, held))
        self._guessing = isinstance(self._source, Prefetcher)   # it reads ahead in `_guess` order
        self.order: list[tuple[int, int]] | None = None   # the forward order, once a whole pass ran
        self._asked: list[tuple[int, int]] = []           # the keys asked for in this pass, until then
        self._released, self._settle, self._copies_only = released, settle, copies_only
        self._block: list | None = None   # [k, started, read seconds, waited seconds] of the block in place
        self._held: dict[int, tuple[Piece, LoadedBlock]] = {}   # piece number -> what fills it
        self._out: dict[int, Key] = {}   # id of each item taken from the reader, not yet given back -> its key
        self.hooks = []
        self._pending: dict[int, int] = {}   # piece number -> its modules that have not run yet
        for k in streamed:
            for i, piece in enumerate(self.pieces[k]):
                for module in piece.modules:
                    self.hooks.append(module.register_forward_pre_hook(functools.partial(self._before, k, i)))
                    self.hooks.append(module.register_forward_hook(functools.partial(self._after, k, i)))

    def _before(self, k: int, i: int, module, args) -> None:
        if i == 0:
            self.release()   # a pass that stopped inside a block (an exception) left it in place
        elif i in self._held:
            return           # filled when another of its modules started
        if self.order is None:
            self._learn((k, i))
        item, waited = self._source.get((k, i))
        self._out[id(item)] = (k, i)
        try:
            fill_block(self._slots[k], item)   # may dequantize here (loader.py: decode_in_reader)
        except BaseException:
            self._give_back(item)   # its buffers and its reader's slot, as a read that failed gives back
            raise
        if i == 0:
            self._block = [k, time.perf_counter(), 0.0, 0.0]
        self._held[i] = (self.pieces[k][i], item)
        self._pending[i] = len(self.pieces[k][i].modules)
        if self._block is not None:
            self._block[2] += item.read_seconds
            self._block[3] += waited

    def _after(self, k: int, i: int, module, args, output) -> None:
        if i == 0:
            self._settle()
            self.release()
        elif i in self._held:
            self._pending[i] -= 1
            if not self._pending[i]:
                self._empty(k, i)

    def _empty(self, k: int, i: int) -> None:
        piece, item = self._held.pop(i)
        self._slots[k].empty(piece.names)
        item.params.clear()
        self._give_back(item)

    def _give_back(self, item: LoadedBlock) -> None:
        del self._out[id(item)]
        self._source.release(item)

    @property
    def depth(self) -> int | None:
        """The pieces read ahead; None: each is read when asked for (prefetching off)."""
        return self._depth

    @property
    def read_ahead(self) -> ReadAhead:
        """How the reader reads ahead now: it changes at the first departure from the guessed order and
        once the first whole pass has run."""
        if isinstance(self._source, CopyAhead):
            return "copy ahead"
        if isinstance(self._source, DirectLoader):
            return "on demand"
        return "guessed order" if self._guessing else "learned order"

    @property
    def handed_out(self) -> frozenset[Key]:
        """The pieces taken from the reader and not given back: those `in_place`, unless one leaked."""
        return frozenset(self._out.values())

    @property
    def in_place(self) -> frozenset[Key]:
        """The pieces whose weights are in the model now."""
        return frozenset((item.index, i) for i, (_, item) in self._held.items())

    def release(self) -> None:
        """Empty the block in place, if any: its memory must be free before the reader starts the next."""
        if self._block is None:
            return
        (k, started, read, waited), self._block = self._block, None
        seconds = time.perf_counter() - started
        for i in sorted(self._held, reverse=True):
            self._empty(k, i)
        self._slots[k].empty()   # also what others filled (on-demand experts)
        self._released(k, read, waited, seconds)
        if self.order is None and k == self.streamed[-1] and self._asked[:1] == [(self.streamed[0], 0)]:
            self._learned()

    def _learn(self, key: tuple[int, int]) -> None:
        """Record `key`; where it departs from the guessed order, read on demand for the rest of the pass."""
        if key == (self.streamed[0], 0):
            self._asked = []
        self._asked.append(key)
        at = len(self._asked) - 1
        if self._guessing and (at >= len(self._guess) or self._guess[at] != key):
            self._source.close()
            self._source, self._guessing = DirectLoader(self._load), False

    def _learned(self) -> None:
        """A whole pass ran: from now on the reader reads ahead, in the order that pass asked."""
        self.order, self._asked = self._asked, []
        if self._depth is not None and self._copies_only():
            self._source.close()
            self._source = CopyAhead(self._load, self.order, self._depth)
        elif self._depth is not None and not self._guessing:
            self._source.close()
            self._source = Prefetcher(self._load, self.order, self._depth, self._held_keys)

    def close(self) -> None:
        """Empty the block in place, take the hooks off, stop the reader."""
        self.release()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self._source.close()
