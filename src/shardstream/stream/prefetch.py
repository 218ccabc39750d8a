"""Reading the next pieces of blocks on a background thread while the current one computes.

Pieces are used in a fixed cycle (every streamed block's pieces in forward order, then again for
the next token), so the readers simply walk that cycle. A semaphore bounds the pieces in memory at
`depth + 1`: the one computing plus `depth` read ahead; the reader blocks until the consumer
releases one. Keys in `held` (a split block's small piece 0, in place for the whole block) are not
counted: they are small, and counting them would leave no slot for reading ahead.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable

from .loader import LoadedBlock

log = logging.getLogger(__name__)


class Prefetcher:
    """Hands out pieces in cycle order; `get(key)` waits for piece `key`, `release(item)` frees its slot.

    `readers` threads read consecutive pieces at once (each one's slot taken in cycle order, the
    pieces handed out in that order): a piece is a few MiB, and one read at a time leaves the disk
    idle for a request's latency between pieces."""

    def __init__(self, load: Callable[[Hashable], LoadedBlock], order: list, depth: int,
                 held: frozenset = frozenset(), readers: int = 2):
        self._load = load
        self._held = held
        self._slots = threading.Semaphore(depth + 1)
        self._cycle = enumerate(itertools.cycle(order))   # (sequence number, key)
        self._claim = threading.Lock()                      # a reader takes the next key and its slot
        self._done: dict[int, tuple] = {}                   # sequence number -> (key, item, error)
        self._arrived = threading.Condition()
        self._next = 0                                      # the sequence number `get` takes next
        self._out: dict[int, object] = {}  # id of each item handed out, not yet released -> its key
        self._stopped = False
        self._threads = [threading.Thread(target=self._run, name="shardstream-prefetch", daemon=True)
                         for _ in range(readers)]
        for thread in self._threads:
            thread.start()
        # A daemon thread still inside a torch read when the interpreter exits aborts the process
        # ("terminate called without an active exception"): stop it first.
        atexit.register(self.close)

    def _run(self) -> None:
        while True:
            with self._claim:
                number, key = next(self._cycle)
                if key not in self._held:
                    self._slots.acquire()
            if self._stopped:
                return
            try:
                done = (key, self._load(key), None)
            except Exception as error:  # handed to the consumer, who raises it where the piece was needed
                done = (key, None, error)
            with self._arrived:
                self._done[number] = done
                self._arrived.notify_all()

    def _take(self) -> tuple:
        with self._arrived:
            while self._next not in self._done:
                self._arrived.wait()
            self._next += 1
            return self._done.pop(self._next - 1)

    def get(self, key) -> tuple[LoadedBlock, float]:
        """Piece `key` and the seconds spent waiting for it. Pieces read ahead for something else (an
        aborted pass, or a forward that runs modules out of order) are dropped: correct, but a whole
        cycle of reads is lost, hence the warning."""
        started = time.perf_counter()
        warned = False
        while True:
            got, item, error = self._take()
            if got == key and error is None:
                self._out[id(item)] = key
                return item, time.perf_counter() - started
            if item is not None:
                item.cool()
            if got not in self._held:
                self._slots.release()
            if got == key:
                raise error
            if not warned:
                log.warning("streaming wanted %s but had read %s ahead; dropping reads until it comes round "
                            "(a forward pass that stopped early, or modules run out of read order)",
                            _named(key), _named(got))
                warned = True

    def release(self, item: LoadedBlock) -> None:
        """`item` has run: hint its pages cold, free its slot."""
        key = self._out.pop(id(item))
        item.cool()
        if key not in self._held:
            self._slots.release()

    def close(self) -> None:
        """Stop the readers; what they read ahead gives its buffers back to the pool."""
        atexit.unregister(self.close)
        self._stopped = True
        for _ in self._threads:
            self._slots.release()
        for thread in self._threads:
            thread.join(timeout=60)
        for _, item, _ in self._done.values():
            if item is not None:
                item.cool()
        self._done.clear()


def _named(key) -> str:
    return f"block {key[0]} piece {key[1]}" if isinstance(key, tuple) else f"block {key}"


class CopyAhead:
    """No background thread: the consumer's own thread loads the next `depth` pieces of the cycle as it takes
    one. For pieces whose load only queues their copy to the GPU (kept page-locked in host RAM, see
    loader.BlockLoader._reserve) this is all the work there is, and a reader thread would only wait for the
    interpreter lock that the computing thread holds while it launches kernels, leaving the copy engine idle.
    A key out of cycle order drops what was loaded ahead and starts the cycle again after it."""

    def __init__(self, load: Callable[[Hashable], LoadedBlock], order: list, depth: int):
        self._load, self._order, self._depth = load, order, depth
        self._ahead: collections.deque = collections.deque()   # (key, item) loaded, not yet taken
        self._next = 0   # position in `order` of the next key to load

    def get(self, key) -> tuple[LoadedBlock, float]:
        started = time.perf_counter()
        if self._ahead and self._ahead[0][0] != key:
            self.close()
            self._next = self._order.index(key)
        while len(self._ahead) < self._depth + 1:
            upcoming = self._order[self._next]
            self._next = (self._next + 1) % len(self._order)
            self._ahead.append((upcoming, self._load(upcoming)))
        return self._ahead.popleft()[1], time.perf_counter() - started

    def release(self, item: LoadedBlock) -> None:
        item.cool()

    def close(self) -> None:
        while self._ahead:
            self._ahead.popleft()[1].cool()


class DirectLoader:
    """No background thread: read each piece when it is needed (prefetching=False)."""

    def __init__(self, load: Callable[[Hashable], LoadedBlock]):
        self._load = load

    def get(self, key) -> tuple[LoadedBlock, float]:
        item = self._load(key)
        return item, item.read_seconds

    def release(self, item: LoadedBlock) -> None:
        item.cool()

    def close(self) -> None:
        pass
