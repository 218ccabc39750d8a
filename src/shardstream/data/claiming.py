"""What a worker does when it wants work: the step budget and the claim loop around the tracker."""

from __future__ import annotations

import time
from collections.abc import Callable

from shardstream.data.blocks import BlockManager
from shardstream.data.config import TrainConfig
from shardstream.data.tracker import ChunkTracker, Claim
from shardstream.data.workers import CONTEXT
from shardstream.errors import DatasetError


class Budget:
    """Steps left for this run, shared by its processes; `done` feeds the progress bar."""

    def __init__(self, steps: int | None) -> None:
        self.left = CONTEXT.Value("q", -1 if steps is None else steps)
        self.done = CONTEXT.Value("q", 0)

    def take(self, n: int) -> int:
        """Reserve up to `n` steps; returns how many were granted (0 once the budget is spent)."""
        with self.left.get_lock():
            granted = n if self.left.value < 0 else min(n, self.left.value)
            if self.left.value >= 0:
                self.left.value -= granted
        return granted

    def give_back(self, n: int) -> None:
        """Return reserved steps that will not be taken (a chunk lost to another worker)."""
        with self.left.get_lock():
            if self.left.value >= 0:
                self.left.value += n

    def exhausted(self) -> bool:
        return self.left.value == 0

    def count(self, n: int) -> None:
        with self.done.get_lock():
            self.done.value += n

    @property
    def steps_done(self) -> int:
        """The steps counted so far, read without the counter's lock: the lock only keeps the workers' additions
        whole, and a worker stopped while it held it (SIGTERM or SIGKILL inside `count`) leaves it held for good,
        so a reader that took it would wait forever."""
        return self.done.get_obj().value


def next_claim(tracker: ChunkTracker, blocks: BlockManager, owner: str, cfg: TrainConfig, budget: Budget,
               on_idle: Callable[[], None] = lambda: None) -> Claim | None:
    """The next chunk to train, or None when the steps are spent or the data is done.

    Nothing claimable has four reasons: blocks not yet read (read the next one and register it),
    the epoch done (roll over with --iterate, else stop), or leases still running (wait: one of
    them may expire and come back to the pool). Before each wait `on_idle` runs: a worker's own
    trained chunks stay leased until a checkpoint holds them, so it saves and heartbeats there.
    """
    poll = min(0.5, cfg.lease_seconds / 10)
    while not budget.exhausted():
        claim = tracker.claim(owner, cfg.lease_seconds)
        if claim is not None:
            return claim
        status = tracker.epoch_status()
        if status.total_blocks is None:
            info = blocks.block(status.blocks_registered)
            if info is None:
                raise DatasetError(f"dataset {cfg.dataset} ends before block {status.blocks_registered} that the tracker expects; "
                                   "use a new --tracker for changed data.")
            tracker.register_block(info.index, info.chunk_count(cfg.chunk_size), info.is_last)
        elif status.complete:
            if not cfg.iterate:
                return None
            tracker.advance_epoch(status.epoch)
        else:
            on_idle()
            time.sleep(poll)
    return None
