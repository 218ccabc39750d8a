"""One writer per store at a time: an flock'd `.lock` file in the store folder.

`convert` and the commands that edit a finished store (`shard`, `relocate`) each discard the temp files
they find and rewrite the manifest, so two at once destroy each other's work. The kernel releases an
flock when its process ends, however it ends, so a killed run never leaves a stale lock. The holder
writes its pid and command into the file, for the message the other one gets; the file itself stays
(removing it would let a third process lock a new file while the second still holds the old one).
"""

from __future__ import annotations

import fcntl
import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..errors import StoreBusy
from .manifest import load_manifest
from .reader import Store

LOCK_NAME = ".lock"
R = TypeVar("R")


@contextmanager
def store_lock(root: Path) -> Iterator[None]:
    """Hold the store's lock, or raise StoreBusy naming the process that holds it."""
    fd = os.open(Path(root) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "its pid is not written yet"
            raise StoreBusy(
                f"another process is writing the store at {root} ({holder}); wait for it to finish (or stop it), "
                "then run this command again."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {_command()}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def editing(edit: Callable[..., R]) -> Callable[..., R]:
    """For a function that edits a finished store (its first argument): it runs holding the store's lock,
    on the manifest as the previous writer left it (not as it was when the store was opened)."""

    @functools.wraps(edit)
    def locked(store: Store, *args, **kwargs) -> R:
        with store_lock(store.root):
            store.manifest = load_manifest(store.root)
            return edit(store, *args, **kwargs)

    return locked


def _command() -> str:
    """This process's command line as the user typed it (`shardstream convert ...` however it was started)."""
    program = Path(sys.argv[0])
    name = "shardstream" if program.parent.name == "shardstream" else program.name
    return " ".join([name, *sys.argv[1:]])
