"""Catch a real command while it holds a store's lock (store/lock.py), as the kernel reports it in /proc/locks."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest


def holds_lock(pid: int, store: Path) -> bool:
    try:
        inode = os.stat(store / ".lock").st_ino
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "FLOCK" in fields and str(pid) in fields and any(f.endswith(f":{inode}") for f in fields):
            return True
    return False


def stop_while_locked(proc: subprocess.Popen, store: Path, timeout: float = 120.0) -> None:
    """SIGSTOP `proc` as soon as it holds the lock of `store` and has written its pid there (a moment after
    taking it), so a second command meets it there and is told who holds it."""
    if not Path("/proc/locks").is_file():
        pytest.skip("needs Linux's /proc/locks")
    deadline = time.monotonic() + timeout
    while not (holds_lock(proc.pid, store) and _names(store / ".lock", proc.pid)):
        assert proc.poll() is None, f"the first command ended without ever holding {store}/.lock"
        assert time.monotonic() < deadline, f"the first command never held {store}/.lock"
        time.sleep(0.002)
    proc.send_signal(signal.SIGSTOP)
    assert holds_lock(proc.pid, store), "the first command ended before it could be stopped; run the test again"


def _names(lock: Path, pid: int) -> bool:
    """Whether the lock file says `pid` holds it."""
    try:
        return lock.read_text(errors="replace").startswith(f"pid {pid}:")
    except FileNotFoundError:
        return False
