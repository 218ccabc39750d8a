"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

A reader (or a resumed run) never sees a half-written file under its final name; at worst it
finds a `.tmp-*` file, which `discard_temp_files` removes.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import DiskSpaceError

TEMP_PREFIX = ".tmp-"


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write data to path so that path holds either the old content or all of the new."""
    write_chunks_atomic(path, [data])


def write_chunks_atomic(path: Path, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
    """Like write_bytes_atomic, from pieces, so a large file never has to exist whole in memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb", buffering=0) as handle:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[handle.write(view):]
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DiskSpaceError(
                f"the disk filled up while writing {path}; free some space and re-run (finished parts are kept)."
            ) from None
        raise
    fsync_dir(path.parent)


def write_with_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """For libraries that write to a path themselves (torch.save, pyarrow): same guarantees."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX + path.name + ".", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, value: object) -> None:
    write_bytes_atomic(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def copy_file_atomic(src: Path, dest: Path) -> None:
    write_bytes_atomic(dest, Path(src).read_bytes())


def discard_temp_files(root: Path) -> list[Path]:
    """Remove leftovers of interrupted atomic writes under root; return what was removed."""
    removed = []
    for tmp in Path(root).rglob(TEMP_PREFIX + "*"):
        if tmp.is_file():
            tmp.unlink()
            removed.append(tmp)
    return removed
