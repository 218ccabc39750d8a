"""Reading block files into reused, page-aligned buffers, past the page cache.

Under a memory cap that counts the page cache (a container's cgroup) and a model larger than the
cap, every block is read again each token. Through the page cache and kept there, each read first
makes the kernel reclaim the pages of an earlier block, and that reclaim, not the disk, sets the
speed. Two ways around it read into our own buffers, so the same few buffers serve every token:

- 'direct': O_DIRECT, from the disk straight into the buffers, nothing in the page cache and no
  copy on the CPU (DeepSpeed's NVMe offload reads this way). The buffers are backed by transparent
  huge pages (`read_buffer`): with 4 KiB pages a request holds at most the queue's max_segments
  pages and O_DIRECT reads slower than the page cache; with 2 MiB pages it
  reads faster than ordinary reads, and faster than 'dropped' below (docs/BENCHMARKS.md, section
  "Real shapes"). A GPU's page-locked buffers are read so too. A filesystem without O_DIRECT (tmpfs,
  some FUSE mounts) raises `DirectUnsupported`, and the caller maps the file instead.
- 'dropped': an ordinary read, the kernel's readahead keeping several requests in flight, then the
  range's pages are dropped from the page cache at once (POSIX_FADV_DONTNEED), so there is little to
  reclaim. It costs a copy out of the page cache on the reader threads, which the computing thread
  feels on a small CPU; 'auto' takes it where the kernel gives no huge pages.

When the whole model fits in memory, mapping stays the faster way (a warm page cache), so
`block_reading` chooses.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import xxhash

from ..errors import InvalidOption
from ..store import Store, problems
from ..store.checksum import checksum_bytes
from ..switches import DIRECT_IO
from ..store.direct_io import aligned, open_file, read_at
from ..memory import available_memory

MODES = ("auto", "on", "off", "dropped")
READINGS = ("mapped", "dropped", "direct")


def block_reading(store: Store, mode: str | None = None, memory: int | None = None, copy_free: bool = False,
                  blocks: range | None = None) -> str:
    """How streamed blocks are read (one of READINGS), from `mode` (default: $SHARDSTREAM_DIRECT_IO, else
    'auto'): 'on' is O_DIRECT, 'off' mapping, 'dropped' ordinary reads dropped from the page cache.

    'auto' maps the blocks (`blocks`, default all) when their files fit in `memory` (default the memory available, a cgroup cap
    included); otherwise caching them only costs reclaim, and it reads past the cache: with O_DIRECT where
    the read buffers get huge pages or a copy on the CPU costs more than it gains (`copy_free`: a GPU's
    page-locked buffers, a compute-bound batch), else dropped reads (see the module docstring).
    """
    mode = (mode or DIRECT_IO.get()).lower()
    if mode not in MODES:
        raise InvalidOption(f"{DIRECT_IO.name} must be one of {', '.join(MODES)}, not {mode!r}; unset it to let shardstream choose.")
    if mode == "off" or getattr(store, "remote", False):
        return "mapped"
    if mode == "dropped":
        return "dropped"
    if not hasattr(os, "O_DIRECT"):
        return "mapped" if mode == "on" else "dropped"
    if mode == "on":
        return "direct"
    files = store.manifest.files
    parts = {f"mid/{index}" for index in (range(store.num_layers) if blocks is None else blocks)}
    size = sum(files[f].size for p, rec in store.manifest.parts.items() if p in parts for f in rec.files)
    if size <= (available_memory()[0] if memory is None else memory):
        return "mapped"
    return "direct" if copy_free or huge_pages() else "dropped"


def huge_pages() -> bool:
    """The kernel gives transparent huge pages to buffers that ask (`read_buffer`): `always` or `madvise`
    in /sys/kernel/mm/transparent_hugepage/enabled."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


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
        buffer = read_buffer(need)
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


def read_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer to read files into, backed by huge pages where the kernel gives them.

    Private, not the shared mapping `mmap.mmap(-1, n)` makes (shared anonymous memory gets no transparent
    huge pages). With 4 KiB pages an O_DIRECT request holds at most the queue's max_segments pages;
    with 2 MiB pages each request is as large as the queue takes, and reads faster (docs/BENCHMARKS.md:
    the machines' disk, and section "Real shapes", have the figures)."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def _open(path, direct: bool = True) -> int:
    try:
        return open_file(path, direct)
    except FileNotFoundError:
        raise problems.missing(path) from None


def _check_size(store: Store, file_name: str, fd: int, path) -> int:
    size = os.fstat(fd).st_size
    if size != store.manifest.files[file_name].size:
        raise problems.wrong_size(path, size, store.manifest.files[file_name].size)
    return size


def verify_unkept(store: Store, file_name: str, direct: bool = True, chunk: int = 1 << 20) -> None:
    """Hash the whole file through one small buffer, leaving nothing in the page cache (O_DIRECT, or each
    chunk's pages dropped once hashed); StoreCorrupt if it differs."""
    path = store.file_path(file_name)
    fd = _open(path, direct)
    try:
        size = _check_size(store, file_name, fd, path)
        buffer = read_buffer(chunk)
        view = memoryview(buffer)
        hasher = xxhash.xxh3_128()
        done = 0
        while done < size:
            got = read_at(fd, path, view, done)
            if not got:
                break
            hasher.update(view[:min(got, size - done)])
            if not direct:
                os.posix_fadvise(fd, done, got, os.POSIX_FADV_DONTNEED)
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
                direct: bool = True, drop: bool = False) -> int:
    """Read each aligned (begin, end) file range of `spans` into `buffer` one after another from
    position `at`; returns the position after the last. The file's size is checked first. `direct`:
    with O_DIRECT, else through the page cache, each range's pages dropped once read when `drop`."""
    path = store.file_path(file_name)
    fd = _open(path, direct)
    try:
        size = _check_size(store, file_name, fd, path)
        whole = memoryview(buffer)
        for begin, end in spans:
            got = read_at(fd, path, whole[at:at + end - begin], begin)
            if got < min(end, size) - begin:
                raise problems.shorter(path)
            if drop and not direct:
                os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_DONTNEED)
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
        done = read_at(fd, path, memoryview(buffer), 0)
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
