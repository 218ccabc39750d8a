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

import xxhash

from ..errors import InvalidOption
from ..store import Store, problems
from ..store.checksum import checksum_bytes
from ..memory import available_memory

ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length aligned to the logical block size
MODES = ("auto", "on", "off")
ENV = "SHARDSTREAM_DIRECT_IO"


class DirectUnsupported(OSError):
    """This file's filesystem refuses O_DIRECT; map the file instead."""


def use_direct(store: Store, mode: str | None = None, memory: int | None = None) -> bool:
    """Whether blocks should be read with O_DIRECT: `mode` (default: $SHARDSTREAM_DIRECT_IO, else 'auto').

    'auto' reads directly when the blocks cannot all stay in the page cache (their files are larger
    than `memory`, default the memory available, a cgroup cap included): then caching them only
    costs reclaim.
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
    return blocks > (available_memory()[0] if memory is None else memory)


class BufferPool:
    """Page-aligned anonymous buffers: taken for one read, given back once its block (or piece) has run.

    A buffer is reused only for a request of its own (page-rounded) size: callers ask for one size
    per kind of read (see loader.py), so a small request never takes, and then forces a new, big one.
    `pin`: each buffer is registered with CUDA as page-locked once, when made, so that the copies to
    the GPU go straight from it (DMA) instead of through a staging copy; `close` unregisters them."""

    def __init__(self, pin: bool = False) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._pinned: list[int] = []  # addresses registered with CUDA
        self.pin = pin
        self.allocated = 0  # buffers made so far: with reuse, the pieces in flight, not the pieces read

    def take(self, size: int) -> mmap.mmap:
        need = aligned(max(size, 1))
        with self._lock:
            for buffer in self._free:
                if len(buffer) == need:
                    self._free.remove(buffer)
                    return buffer
            self.allocated += 1
        buffer = mmap.mmap(-1, need)  # anonymous mappings are page-aligned
        if self.pin:
            self._register(buffer)
        return buffer

    def _register(self, buffer: mmap.mmap) -> None:
        import torch

        address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        error = torch.cuda.cudart().cudaHostRegister(address, len(buffer), 0)
        if error != 0:
            raise InvalidOption(f"CUDA could not page-lock a {len(buffer) >> 20} MiB read buffer in host RAM "
                                f"(cudaHostRegister error {int(error)}); free host RAM, or lower max_host_memory.")
        with self._lock:
            self._pinned.append(address)

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self._lock:
            self._free.extend(buffers)
        buffers.clear()

    def close(self) -> None:
        """Unregister the pinned buffers (before their memory is unmapped); the pool is not used after."""
        import torch

        with self._lock:
            pinned, free = self._pinned, self._free   # `free` keeps the buffers mapped until unregistered
            self._pinned, self._free = [], []
        for address in pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        free.clear()


def aligned(offset: int) -> int:
    """`offset` rounded up to the O_DIRECT alignment."""
    return -(-offset // ALIGN) * ALIGN


def _open(path, direct: bool = True) -> int:
    try:
        return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except FileNotFoundError:
        raise problems.missing(path) from None
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise DirectUnsupported(error.errno, f"{path}: O_DIRECT not supported") from None
        raise


def _pread(fd: int, path, view: memoryview, offset: int) -> int:
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


def _check_size(store: Store, file_name: str, fd: int, path) -> int:
    size = os.fstat(fd).st_size
    if size != store.manifest.files[file_name].size:
        raise problems.wrong_size(path, size, store.manifest.files[file_name].size)
    return size


def verify_direct(store: Store, file_name: str, chunk: int = 1 << 20) -> None:
    """Hash the whole file through one small buffer (nothing enters the page cache); StoreCorrupt if it differs."""
    path = store.file_path(file_name)
    fd = _open(path)
    try:
        size = _check_size(store, file_name, fd, path)
        buffer = mmap.mmap(-1, chunk)
        view = memoryview(buffer)
        hasher = xxhash.xxh3_128()
        done = 0
        while done < size:
            got = _pread(fd, path, view, done)
            if not got:
                break
            hasher.update(view[:min(got, size - done)])
            done += got
        view.release()
        buffer.close()
    finally:
        os.close(fd)
    if done < size:
        raise problems.shorter(path)
    if hasher.hexdigest() != store.manifest.files[file_name].xxh3_128:
        raise problems.fails_checksum(path)


def read_ranges(store: Store, file_name: str, spans: list[tuple[int, int]], buffer: mmap.mmap, at: int,
                direct: bool = True) -> int:
    """Read each aligned (begin, end) file range of `spans` into `buffer` one after another from
    position `at`; returns the position after the last. The file's size is checked first. `direct`:
    with O_DIRECT, else through the page cache."""
    path = store.file_path(file_name)
    fd = _open(path, direct)
    try:
        size = _check_size(store, file_name, fd, path)
        whole = memoryview(buffer)
        for begin, end in spans:
            got = _pread(fd, path, whole[at:at + end - begin], begin)
            if got < min(end, size) - begin:
                raise problems.shorter(path)
            at += end - begin
    finally:
        os.close(fd)
    return at


def read_direct(store: Store, file_name: str, pool: BufferPool, verify: bool = False,
                capacity: int = 0) -> tuple[mmap.mmap, memoryview]:
    """(pool buffer of at least `capacity` bytes, view of exactly the file's bytes), checksum-verified when `verify`."""
    path = store.file_path(file_name)
    fd = _open(path)
    buffer = None
    try:
        size = _check_size(store, file_name, fd, path)
        buffer = pool.take(max(size, capacity))
        done = _pread(fd, path, memoryview(buffer), 0)
        if done < size:
            raise problems.shorter(path)
        view = memoryview(buffer)[:size]
        if verify and checksum_bytes(view) != store.manifest.files[file_name].xxh3_128:
            raise problems.fails_checksum(path)
    except BaseException:
        if buffer is not None:
            pool.give([buffer])
        raise
    finally:
        os.close(fd)
    return buffer, view
