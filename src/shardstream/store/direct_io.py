"""O_DIRECT reads of store files, for the stream runtime's blocks (stream/direct.py) and for MoE
experts (sharding.Expert.fill: one read each, at its aligned offset in its container): where a
filesystem or a buffer refuses O_DIRECT, one exception says so, and the caller reads another way. A read
that may be stopped halfway (an expert read ahead of its router, which may not pick it) is requested in
STOP_PIECE pieces until it is stopped or kept (`Stoppable`)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length aligned to the logical block size
# A stoppable read's request size: a stop waits for one request at most, and smaller requests read a fast disk
# more slowly than whole ones, a right guess's too (docs/BENCHMARKS.md, "Guesses from the residual stream" and
# "Guesses once the block's reads have landed"). A read smaller than this is one request: only a stop before
# it begins saves its bytes.
STOP_PIECE = 8 << 20
# a request's size where each piece is handed on as it lands (`landed`): the last one is what is left to
# handle once the read ends
LANDED_PIECE = 32 << 20


class DirectUnsupported(OSError):
    """This file's filesystem (or this buffer) refuses O_DIRECT; read it another way."""


class ReadStopped(Exception):
    """A stoppable read was stopped before its end; `done` bytes had been read."""

    def __init__(self, done: int):
        super().__init__(f"read stopped after {done} bytes")
        self.done = done


class Stoppable:
    """Lets another thread end a read before its next request (`stopped`), or, once it is sure to be wanted,
    let it go on in its usual requests (`kept`); until either, it asks for STOP_PIECE bytes at a time, so that
    a stop waits for one such request at most."""

    def __init__(self) -> None:
        self.stopped = False
        self.kept = False

    def piece(self, usual: int, done: int) -> int:
        """The size of the read's next request, `done` bytes into it; ReadStopped once stopped."""
        if self.stopped:
            raise ReadStopped(done)
        return usual if self.kept else STOP_PIECE


def aligned(offset: int) -> int:
    """`offset` rounded up to the O_DIRECT alignment."""
    return -(-offset // ALIGN) * ALIGN


def open_file(path, direct: bool = True) -> int:
    """A descriptor to read `path` (with O_DIRECT when `direct`); FileNotFoundError as it comes."""
    try:
        return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise DirectUnsupported(error.errno, f"{path}: O_DIRECT not supported") from None
        raise


def read_at(fd: int, path, view: memoryview, offset: int, stop: Stoppable | None = None,
            landed: Callable[[int], None] | None = None) -> int:
    """Fill `view` from file offset `offset` (aligned); fewer bytes only at the end of the file. `stop`: a
    read that may be stopped (`Stoppable`). `landed`: told the bytes read so far after each request (of
    LANDED_PIECE bytes at most)."""
    done = 0
    while done < len(view):
        usual = len(view) - done if landed is None else min(len(view) - done, LANDED_PIECE)
        piece = usual if stop is None else stop.piece(usual, done)
        try:
            got = os.preadv(fd, [view[done:done + piece]], offset + done)
        except OSError as error:
            if error.errno == errno.EINVAL:  # open accepted O_DIRECT, the read did not
                raise DirectUnsupported(error.errno, f"{path}: O_DIRECT read refused") from None
            raise
        if not got:
            break
        done += got
        if landed is not None:
            landed(done)
    return done
