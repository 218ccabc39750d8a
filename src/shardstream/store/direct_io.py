"""O_DIRECT reads of store files, for the stream runtime's blocks (stream/direct.py) and for MoE
experts (sharding.Expert.read_into: one read each, at its aligned offset in its container): where a
filesystem or a buffer refuses O_DIRECT, one exception says so, and the caller reads another way."""

from __future__ import annotations

import errno
import os

ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length aligned to the logical block size


class DirectUnsupported(OSError):
    """This file's filesystem (or this buffer) refuses O_DIRECT; read it another way."""


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


def read_at(fd: int, path, view: memoryview, offset: int) -> int:
    """Fill `view` from file offset `offset` (aligned); fewer bytes only at the end of the file."""
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as error:
            if error.errno == errno.EINVAL:  # open accepted O_DIRECT, the read did not
                raise DirectUnsupported(error.errno, f"{path}: O_DIRECT read refused") from None
            raise
        if not got:
            break
        done += got
    return done
