"""xxh3-128 checksums: fast enough to re-hash a whole store at disk speed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from . import direct_io

READ_SIZE = 8 * 1024 * 1024


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def checksum_file(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    buffer = bytearray(READ_SIZE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            hasher.update(view[:n])
    return hasher.hexdigest()


class HashAsRead:
    """The xxh3-128 of `data` (a buffer being read into), hashed as the read says its bytes have landed
    (`landed`): while more is to come, in pieces of direct_io.LANDED_PIECE bytes or more on a thread of its
    own, so that the checksum is ready soon after the read ends instead of taking a pass over the bytes after
    it; the rest by whoever asks (`hexdigest`). A read shorter than such a piece starts no thread."""

    def __init__(self, data: memoryview):
        self._data, self._sent, self._landed = data, 0, 0
        self._hasher = xxhash.xxh3_128()
        self._thread: ThreadPoolExecutor | None = None

    def landed(self, done: int) -> None:
        """The first `done` bytes of the read are in `data` (bytes past its end are not hashed)."""
        self._landed = min(done, len(self._data))
        if self._landed < len(self._data) and self._landed - self._sent >= direct_io.LANDED_PIECE:   # more to come
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="hashing")
            self._thread.submit(self._hasher.update, self._data[self._sent:self._landed])
            self._sent = self._landed

    def hexdigest(self) -> str:
        """The checksum of the bytes landed."""
        self.close()
        if self._landed > self._sent:
            self._hasher.update(self._data[self._sent:self._landed])
            self._sent = self._landed
        return self._hasher.hexdigest()

    def close(self) -> None:
        """Wait for the pieces handed on (a read that failed: its buffer may go to another read)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
