"""SQLite tracker: one file, WAL mode, for every worker on one machine.

`BEGIN IMMEDIATE` takes the write lock at the start of a transaction, so a claim's read and update
cannot interleave with another claim. Writers first queue on an flock of a sidecar `.lock` file:
the kernel wakes the next one the moment the lock is free, where SQLite's own busy handler sleeps
and polls (docs/BENCHMARKS.md, section "Training data"). `synchronous=NORMAL` in WAL mode survives
any process crash (SIGKILL included); only a power cut can drop the last commits.
"""

from __future__ import annotations

import fcntl
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardstream.data.tracker_base import ChunkTracker
from shardstream.errors import TrackerCorrupt, TrackerUnavailable

BUSY_TIMEOUT_S = 60.0


class SqliteTracker(ChunkTracker):
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.url = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer_lock = open(self.path.with_name(self.path.name + ".lock"), "a")
        with self._errors():
            self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as e:
            if "malformed" in str(e) or "not a database" in str(e):
                raise self._corrupt(e) from None
            raise TrackerUnavailable(f"tracker file {self.path} cannot be used ({e}); check its permissions and free disk space.") from None
        except sqlite3.DatabaseError as e:
            raise self._corrupt(e) from None

    def _corrupt(self, e: Exception) -> TrackerCorrupt:
        return TrackerCorrupt(f"tracker file {self.path} is not a valid SQLite database ({e}); move it aside and "
                              "import its last chunk_tracker_state.json into a new --tracker.")

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[sqlite3.Cursor]:
        if write:
            fcntl.flock(self._writer_lock, fcntl.LOCK_EX)
        try:
            with self._errors():
                cur = self.conn.cursor()
                cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield cur
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT")
        finally:
            if write:
                fcntl.flock(self._writer_lock, fcntl.LOCK_UN)

    def close(self) -> None:
        self.conn.close()
        self._writer_lock.close()
