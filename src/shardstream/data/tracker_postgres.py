"""PostgreSQL tracker: one server, workers on many machines.

Claims lock only the row they take (`FOR UPDATE SKIP LOCKED`), so concurrent claims never wait on
each other. A transaction cut by a dropped connection fails as a whole (nothing half-written, no
completed record lost); the next call reconnects, a few times with back-off, before giving up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from shardstream.data.tracker_base import ChunkTracker
from shardstream.errors import TrackerUnavailable

CONNECT_TIMEOUT_S = 5
RETRIES = 3
# Any constant: serializes concurrent CREATE TABLE IF NOT EXISTS, which PostgreSQL does not.
SCHEMA_LOCK_KEY = 0x5348_5354


class PostgresTracker(ChunkTracker):
    now_sql = "extract(epoch from clock_timestamp())::double precision"
    lock_sql = "FOR UPDATE SKIP LOCKED"
    placeholder = "%s"

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection | None = None
        self._connect()

    def _unavailable(self, e: Exception) -> TrackerUnavailable:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return TrackerUnavailable(f"tracker database {self._safe_url()} cannot be reached ({detail}); "
                                  "check that the server runs and the URL, user and password are right.")

    def _safe_url(self) -> str:
        """The URL without its password, for messages."""
        info = psycopg.conninfo.conninfo_to_dict(self.url)
        return f"postgresql://{info.get('user', '')}@{info.get('host', '')}:{info.get('port', '5432')}/{info.get('dbname', '')}"

    def _connect(self) -> None:
        try:
            self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as e:
            raise self._unavailable(e) from None

    def _create_schema(self, cur: psycopg.Cursor) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
        super()._create_schema(cur)

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[psycopg.Cursor]:
        if self.conn is None or self.conn.closed:
            self._reconnect()
        try:
            with self.conn.transaction(), self.conn.cursor() as cur:
                yield cur
        except psycopg.OperationalError as e:
            raise self._unavailable(e) from None

    def _reconnect(self) -> None:
        """A connection that broke earlier: try a few times, backing off, before giving up."""
        for attempt in range(RETRIES):
            try:
                return self._connect()
            except TrackerUnavailable:
                if attempt == RETRIES - 1:
                    raise
                time.sleep(0.5 * 2**attempt)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
