"""Which MoE experts stay in memory between passes: those routed to often and lately.

A token picks a few experts of each block, and the next tokens pick many of the same ones again (a
router favours some experts, a text repeats itself). An expert kept in memory is a read saved; the
question is which to keep when not all fit. Least-recently-used keeps the experts of the last tokens
and drops a popular expert the moment a few rare ones pass by; counting alone keeps experts that were
popular long ago. `ExpertCache` scores each expert by its routings, each one's weight halving every
`half_life` passes of its block (`half_life=0`: the latest routing alone, which is LRU), and keeps the
best-scoring experts that fit in `budget` bytes. It remembers the scores of experts it does not hold,
so an expert becomes worth keeping by being routed to, not by being the last one read.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

Held = TypeVar("Held")


@dataclass
class _Score:
    value: float = 0.0
    at: int = 0     # the block's pass count when `value` was last brought up to date
    last: int = 0   # the order of the latest routing among all routings: ties (and LRU) go by it

    def now(self, clock: int, decay: float) -> float:
        return self.value * decay ** (clock - self.at) if decay else 0.0


@dataclass
class CacheStats:
    """What the cache saved: `hits` routings served from memory, `misses` routings that read their expert."""
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache(Generic[Held]):
    """Experts in memory, keyed by (block, expert), within `budget` bytes, chosen by their decayed routing
    counts (module docstring). `release` is called with what an evicted entry held (its read buffer goes
    back to the pool)."""

    def __init__(self, budget: int, half_life: float, release: Callable[[Held], None]):
        self.budget = budget
        self._decay = 0.5 ** (1 / half_life) if half_life else 0.0
        self._release = release
        self._held: dict[Hashable, tuple[Held, int]] = {}
        self._per_block: Counter[Hashable] = Counter()   # experts held, by block
        self._scores: dict[Hashable, _Score] = {}
        self._clocks: dict[Hashable, int] = {}
        self._routings = 0
        self.held_bytes = 0
        self.peak_bytes = 0   # the most bytes held at once
        self.stats = CacheStats()

    def tick(self, block: Hashable) -> None:
        """One pass of `block`'s experts begins."""
        self._clocks[block] = self._clocks.get(block, 0) + 1

    def holds(self, block: Hashable, expert: int) -> bool:
        """Whether the expert is held, counting no routing."""
        return (block, expert) in self._held

    def held_in(self, block: Hashable) -> int:
        """How many of `block`'s experts are held."""
        return self._per_block[block]

    def get(self, block: Hashable, expert: int) -> Held | None:
        """The expert if held; either way one routing to it is counted."""
        key = (block, expert)
        score = self._scores.setdefault(key, _Score())
        clock = self._clocks.get(block, 0)
        self._routings += 1
        score.value, score.at, score.last = score.now(clock, self._decay) + 1, clock, self._routings
        held = self._held.get(key)
        if held is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return held[0]

    def offer(self, block: Hashable, expert: int, held: Held, nbytes: int, keep: frozenset[int] = frozenset()) -> bool:
        """Keep a just-read expert if it fits, dropping lower-scored experts (not those of `block` in `keep`: the
        pass still needs them) to make room; False (the caller frees it) when it does not fit or scores lower
        than what it would displace."""
        key = (block, expert)
        if key in self._held or nbytes > self.budget:
            return False
        mine = self._score(key)
        victims, freed = [], self.budget - self.held_bytes
        for other in sorted(self._held, key=self._score) if freed < nbytes else ():   # ranked only to make room
            if freed >= nbytes:
                break
            if other[0] == block and other[1] in keep:
                continue
            if self._score(other) > mine:
                return False
            victims.append(other)
            freed += self._held[other][1]
        if freed < nbytes:
            return False
        for other in victims:
            self._drop(other)
        self._held[key] = (held, nbytes)
        self._per_block[block] += 1
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return True

    def shrink(self, budget: int) -> None:
        """Set a new budget, dropping the lowest-scored experts until the held ones fit it."""
        self.budget = budget
        for key in sorted(self._held, key=self._score):
            if self.held_bytes <= budget:
                break
            self._drop(key)

    def clear(self) -> None:
        for key in list(self._held):
            self._drop(key)

    def __len__(self) -> int:
        return len(self._held)

    def _score(self, key: Hashable) -> tuple[float, int]:
        score = self._scores.get(key)
        return (score.now(self._clocks.get(key[0], 0), self._decay), score.last) if score else (-math.inf, 0)

    def _drop(self, key: Hashable) -> None:
        held, nbytes = self._held.pop(key)
        self._per_block[key[0]] -= 1
        self.held_bytes -= nbytes
        self._release(held)
