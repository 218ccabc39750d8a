"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

A reader (or a resumed run) never sees a half-written file under its final name; at worst it
finds a `.tmp-*` file, which `discard_temp_files` removes. `durable=False` skips the two fsyncs for
callers that make many files durable at once later (`fsync_paths`), e.g. the store writer; it starts
the disk writing as the data arrives instead (`start_writeback`), so that later pass finds little
left to wait for.
Files get the mode the umask gives any new file (mkstemp's 0600 would survive the rename).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import DiskSpaceError

TEMP_PREFIX = ".tmp-"
WRITEBACK_BYTES = 32 * 1024 * 1024   # hand dirty data to the disk in steps of this size
WRITEBACK_MIN_BYTES = 1024 * 1024


def _read_umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc), else set back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_read_umask()   # what open(path, "w") would give; read once, at import


def _sync_file_range():
    """Linux's sync_file_range(2) through libc (Python does not wrap it), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing this range to disk now, without waiting for it: a later
    fsync then only waits for the tail. Durability still comes from that fsync alone."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)   # a hint: failures are harmless


def fsync_dir(folder: Path) -> None:
    fsync_paths([folder])


def fsync_paths(paths: Iterable[Path]) -> None:
    """Make files (or folders) written earlier without fsync durable, in one pass."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes_atomic(path: Path, data: bytes | bytearray | memoryview, durable: bool = True) -> None:
    """Write data to path so that path holds either the old content or all of the new."""
    write_chunks_atomic(path, [data], durable)


def write_chunks_atomic(path: Path, chunks: Iterable[bytes | bytearray | memoryview], durable: bool = True) -> None:
    """Like write_bytes_atomic, from pieces, so a large file never has to exist whole in memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb", buffering=0) as handle:
            written = flushed = 0
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                written += len(view)
                while view:
                    view = view[handle.write(view):]
                if not durable and written - flushed >= WRITEBACK_BYTES:
                    start_writeback(handle.fileno(), flushed, written - flushed)
                    flushed = written
            if durable:
                os.fsync(handle.fileno())
            elif written >= WRITEBACK_MIN_BYTES:   # not small files (the manifest): no gain, and
                start_writeback(handle.fileno(), flushed, 0)   # it can wait on the journal; 0: to the end
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DiskSpaceError(
                f"the disk filled up while writing {path}; free some space and re-run (finished parts are kept)."
            ) from None
        raise
    if durable:
        fsync_dir(path.parent)


def write_with_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """For libraries that write to a path themselves (torch.save, pyarrow): same guarantees."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX + path.name + ".", dir=path.parent)
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, value: object, durable: bool = True) -> None:
    write_bytes_atomic(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode(), durable)


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
