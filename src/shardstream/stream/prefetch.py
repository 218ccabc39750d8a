"""Reading the next blocks on a background thread while the current one computes.

Blocks are used in a fixed cycle (0..n-1, then 0 again for the next token), so the reader simply
walks that cycle. A semaphore bounds the blocks in memory at `depth + 1`: the one computing plus
`depth` read ahead; the reader blocks until the consumer releases a block.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import queue
import threading
import time
from collections.abc import Callable

from .loader import LoadedBlock


class Prefetcher:
    """Hands out blocks in cycle order; `get(i)` waits for block i, `release()` frees its slot."""

    def __init__(self, load: Callable[[int], LoadedBlock], order: list[int], depth: int):
        self._load = load
        self._order = order
        self._slots = threading.Semaphore(depth + 1)
        self._ready: queue.Queue = queue.Queue()
        self._out: collections.deque[LoadedBlock] = collections.deque()  # handed out, not yet released
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="shardstream-prefetch", daemon=True)
        self._thread.start()
        # A daemon thread still inside a torch read when the interpreter exits aborts the process
        # ("terminate called without an active exception"): stop it first.
        atexit.register(self.close)

    def _run(self) -> None:
        for index in itertools.cycle(self._order):
            self._slots.acquire()
            if self._stopped:
                return
            try:
                self._ready.put((index, self._load(index), None))
            except Exception as error:  # handed to the consumer, who raises it where the block was needed
                self._ready.put((index, None, error))

    def get(self, index: int) -> tuple[LoadedBlock, float]:
        """Block `index` and the seconds spent waiting for it; blocks read ahead for an aborted pass are dropped."""
        started = time.perf_counter()
        while True:
            got, block, error = self._ready.get()
            if got == index and error is None:
                self._out.append(block)
                return block, time.perf_counter() - started
            if block is not None:
                block.cool()
            self._slots.release()
            if got == index:
                raise error

    def release(self) -> None:
        """The oldest block handed out has run: hint its pages cold, free its slot."""
        if self._out:
            self._out.popleft().cool()
        self._slots.release()

    def close(self) -> None:
        atexit.unregister(self.close)
        self._stopped = True
        self._slots.release()
        self._thread.join(timeout=60)


class DirectLoader:
    """No background thread: read each block when it is needed (prefetching=False)."""

    def __init__(self, load: Callable[[int], LoadedBlock]):
        self._load = load
        self._out: LoadedBlock | None = None

    def get(self, index: int) -> tuple[LoadedBlock, float]:
        block = self._load(index)
        self._out = block
        return block, block.read_seconds

    def release(self) -> None:
        block, self._out = self._out, None
        if block is not None:
            block.cool()

    def close(self) -> None:
        pass
