"""xxh3-128 checksums: fast enough to re-hash a whole store at disk speed."""

from __future__ import annotations

from pathlib import Path

import xxhash

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
