"""Reading block files with O_DIRECT into reused, page-aligned buffers.

Under a memory cap that counts the page cache (a container's cgroup) and a model larger than the
cap, every block is read again each token. Through the page cache, each read first makes the kernel
reclaim the pages of an earlier block, and that reclaim, not the disk, sets the speed. O_DIRECT
reads go from the disk straight into our own buffers: nothing enters the page cache, nothing has
to be reclaimed, and the same few buffers serve every token (DeepSpeed's NVMe offload reads this
way). A filesystem without O_DIRECT (tmpfs, some FUSE mounts) raises `DirectUnsupported`, and the
caller maps the file instead. When the whole model fits in memory, mapping stays the faster way
(a warm page cache), so `use_direct` chooses.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from ..errors import InvalidOption, StoreCorrupt, StoreIncomplete
from ..store import Store
from ..store.checksum import checksum_bytes
from .residency import available_memory

ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length aligned to the logical block size
MODES = ("auto", "on", "off")
ENV = "SHARDSTREAM_DIRECT_IO"


class DirectUnsupported(OSError):
    """This file's filesystem refuses O_DIRECT; map the file instead."""


def use_direct(store: Store, mode: str | None = None) -> bool:
    """Whether blocks should be read with O_DIRECT: `mode` (default: $SHARDSTREAM_DIRECT_IO, else 'auto').

    'auto' reads directly when the blocks cannot all stay in the page cache (their files are larger
    than the memory available, a cgroup cap included): then caching them only costs reclaim.
    """
    mode = (mode or os.environ.get(ENV) or "auto").lower()
    if mode not in MODES:
        raise InvalidOption(f"{ENV} must be one of {', '.join(MODES)}, not {mode!r}; unset it to let shardstream choose.")
    if mode == "off" or getattr(store, "remote", False) or not hasattr(os, "O_DIRECT"):
        return False
    if mode == "on":
        return True
    files = store.manifest.files
    blocks = sum(files[f].size for p, rec in store.manifest.parts.items() if p.startswith("mid/") for f in rec.files)
    return blocks > available_memory()[0]


class BufferPool:
    """Page-aligned anonymous buffers: taken for one file read, given back once its block has run."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made so far: with reuse, the blocks in flight, not the blocks read

    def take(self, size: int) -> mmap.mmap:
        need = max(ALIGN, -(-size // ALIGN) * ALIGN)
        with self._lock:
            fitting = [b for b in self._free if len(b) >= need]
            if fitting:
                buffer = min(fitting, key=len)
                self._free.remove(buffer)
                return buffer
            self.allocated += 1
        return mmap.mmap(-1, need)  # anonymous mappings are page-aligned

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self._lock:
            self._free.extend(buffers)
        buffers.clear()


def read_direct(store: Store, file_name: str, pool: BufferPool, verify: bool = False) -> tuple[mmap.mmap, memoryview]:
    """(pool buffer, view of exactly the file's bytes), checksum-verified when `verify`."""
    path = store.file_path(file_name)
    record = store.manifest.files[file_name]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except FileNotFoundError:
        raise StoreIncomplete(f"{path} is missing; re-run `shardstream convert` to repair the store.") from None
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise DirectUnsupported(error.errno, f"{path}: O_DIRECT not supported") from None
        raise
    buffer = None
    try:
        size = os.fstat(fd).st_size
        if size != record.size:
            raise StoreCorrupt(
                f"{path} is {size} bytes but the manifest says {record.size}; re-run `shardstream convert` to repair the store."
            )
        buffer = pool.take(size)
        whole = memoryview(buffer)
        done = 0
        while done < size:
            try:
                got = os.preadv(fd, [whole[done:]], done)
            except OSError as error:
                if error.errno == errno.EINVAL:  # open accepted O_DIRECT, the read did not
                    raise DirectUnsupported(error.errno, f"{path}: O_DIRECT read refused") from None
                raise
            if not got:
                break
            done += got
    except BaseException:
        if buffer is not None:
            pool.give([buffer])
        raise
    finally:
        os.close(fd)
    if done < size:
        pool.give([buffer])
        raise StoreCorrupt(f"{path} is shorter than the manifest says; re-run `shardstream convert` to repair the store.")
    view = memoryview(buffer)[:size]
    if verify and checksum_bytes(view) != record.xxh3_128:
        pool.give([buffer])
        raise StoreCorrupt(f"{path} fails its checksum; re-run `shardstream convert` to repair the store.")
    return buffer, view
