"""What an agent reports about its machine: capabilities, measured compute and disk reads, round
trips to peers."""

from __future__ import annotations

import errno
import mmap
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch

from ..memory import available_bytes
from ..stream.direct import read_buffer


def capabilities(max_memory: int | None = None) -> dict:
    """What the machine offers; ram_available_bytes is what this agent may still use (see memory.py):
    `max_memory` bounds the whole process, as a container would, so what the process holds already
    (Python, torch: `process_rss_bytes`) comes out of it."""
    memory = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    headroom = None if max_memory is None else max(0, max_memory - rss)
    accelerators = [
        {"type": "cuda", "name": torch.cuda.get_device_name(i), "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]
    if torch.backends.mps.is_available():
        accelerators.append({"type": "mps", "name": "Apple GPU"})
    return {
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "ram_total_bytes": memory.total, "ram_available_bytes": available_bytes(headroom),
        "host_ram_available_bytes": memory.available, "process_rss_bytes": rss,
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "accelerators": accelerators,
    }


def matmul_gflops(size: int, repeats: int) -> float:
    """Square float32 matmuls: the machine's peak-ish compute."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool, caches
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e9


def block_gflops(hidden: int, intermediate: int, tokens: int, repeats: int) -> float:
    """The matmuls of one transformer block (q, k, v, o; gate, up, down) on `tokens` tokens: at decode
    (one token) this is bound by memory bandwidth, which is what a generation step meets."""
    x, h = torch.randn(tokens, hidden), torch.randn(tokens, intermediate)
    square = [torch.randn(hidden, hidden) for _ in range(4)]
    wide = [torch.randn(hidden, intermediate) for _ in range(2)]
    down = torch.randn(intermediate, hidden)

    def block() -> None:
        for w in square:
            x @ w
        for w in wide:
            x @ w
        h @ down

    block()
    started = time.perf_counter()
    for _ in range(repeats):
        block()
    flops = 2 * tokens * (4 * hidden * hidden + 3 * hidden * intermediate) * repeats
    return flops / (time.perf_counter() - started) / 1e9


DISK_PROBE_BYTES = 32 * 2**20
DISK_PROBE_LIMIT = 256 * 2**20
_DISK_CHUNK = 8 * 2**20


def disk_read_bytes_per_s(folder: Path, size: int = DISK_PROBE_BYTES) -> float:
    """How fast this device reads from the disk that holds `folder` (its stage cache), as a streamed
    stage reads its blocks: a fresh file of random bytes, written and synced, then read with O_DIRECT
    (or, where the filesystem refuses it, read after dropping its pages from the page cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".disk-probe-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for done in range(0, size, _DISK_CHUNK):
                out.write(os.urandom(min(_DISK_CHUNK, size - done)))
            out.flush()
            os.fsync(out.fileno())
        return size / cold_read_seconds(name)
    finally:
        os.unlink(name)


def cold_read_seconds(path: str | Path) -> float:
    """Seconds to read the file at `path` from the disk, not the page cache."""
    buffer = read_buffer(_DISK_CHUNK)   # the runtime's kind of buffer: page-aligned, huge pages
    buffer.write(bytes(_DISK_CHUNK))   # fault its pages in now: under a memory cap that can mean reclaim,
    try:                               # which the runtime's reused buffers do not pay for every block
        for flags in (os.O_RDONLY | getattr(os, "O_DIRECT", 0), os.O_RDONLY):
            try:
                return _timed_read(path, flags, buffer)
            except OSError as error:   # no O_DIRECT here (tmpfs, some FUSE mounts): read after dropping the pages
                if error.errno != errno.EINVAL or flags == os.O_RDONLY:
                    raise
        raise AssertionError("unreachable: the plain read either returns or raises")
    finally:
        buffer.close()


def _timed_read(path: str, flags: int, buffer: mmap.mmap) -> float:
    fd = os.open(path, flags)
    try:
        if hasattr(os, "posix_fadvise"):   # a no-op under O_DIRECT; otherwise the read must come from the disk
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        started, offset = time.perf_counter(), 0
        while got := os.preadv(fd, [buffer], offset):
            offset += got
        return max(time.perf_counter() - started, 1e-6)
    finally:
        os.close(fd)


PROBE_LIMIT = 64 * 2**20


def ping(peers: list[str], headers: dict[str, str], timeout: float,
         probe_bytes: int = 0) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Per peer: the median round trip (seconds) of three health requests, and, with `probe_bytes`,
    the bandwidth (bytes/s) of fetching that many bytes from its `/v1/net/blob`, less one round
    trip. None where a peer is unreachable."""
    rtts: dict[str, float | None] = {}
    bandwidths: dict[str, float | None] = {}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for peer in peers:
            base = peer.rstrip("/")
            rtts[peer] = bandwidths[peer] = None
            try:
                samples = []
                for _ in range(3):
                    started = time.perf_counter()
                    client.get(base + "/v1/health").raise_for_status()
                    samples.append(time.perf_counter() - started)
                rtts[peer] = sorted(samples)[1]
                if probe_bytes:
                    started = time.perf_counter()
                    response = client.get(base + "/v1/net/blob", params={"size": probe_bytes})
                    response.raise_for_status()
                    elapsed = time.perf_counter() - started - rtts[peer]
                    bandwidths[peer] = len(response.content) / max(elapsed, 1e-6)
            except httpx.HTTPError:
                pass
    return rtts, bandwidths
