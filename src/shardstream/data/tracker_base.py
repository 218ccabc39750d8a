"""The chunk tracker: which (epoch, block, chunk) is pending, leased to whom until when, or done.

Both backends are SQL databases and share every statement here; a backend only says how to
connect, how to open a write transaction, what "now" is, and whether claims lock rows
(`FOR UPDATE SKIP LOCKED`) or the whole database (SQLite). "Now" is always the database's clock, so
machines with drifting clocks agree on when a lease expires.

Invariants: a claim is one transaction; a chunk is handed out only while pending or while its lease
has expired; completing or heartbeating needs the claim's (owner, attempts) token, so a worker whose
lease was taken over can neither finish the chunk a second time nor extend the new owner's lease.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from shardstream.data import tracker_state
from shardstream.errors import InvalidOption

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS shardstream_tracker (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        source TEXT NOT NULL,
        samples_per_block INTEGER NOT NULL,
        chunk_size INTEGER NOT NULL,
        current_epoch INTEGER NOT NULL DEFAULT 0,
        total_blocks INTEGER,
        total_steps BIGINT NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS shardstream_chunks (
        epoch INTEGER NOT NULL,
        block INTEGER NOT NULL,
        chunk INTEGER NOT NULL,
        state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'leased', 'done')),
        owner TEXT,
        lease_expires DOUBLE PRECISION,
        attempts INTEGER NOT NULL DEFAULT 0,
        worker TEXT,
        step BIGINT,
        samples INTEGER,
        completed_at DOUBLE PRECISION,
        PRIMARY KEY (epoch, block, chunk))""",
    "CREATE INDEX IF NOT EXISTS shardstream_chunks_claim ON shardstream_chunks (epoch, state, block, chunk)",
]

_OWNED = "epoch = ? AND block = ? AND chunk = ? AND state = 'leased' AND owner = ? AND attempts = ?"
_CHUNK_COLUMNS = "epoch, block, chunk, state, owner, lease_expires, attempts, worker, step, samples, completed_at"


def dataset_name(source: str) -> str:
    """What a tracker knows a dataset by: a file's or folder's own name (the machines that share a tracker
    may keep the data in different folders), an hf:// or URL source whole."""
    if "://" in source:
        return source
    return PurePath(source.rstrip("/\\")).name or source


@dataclass(frozen=True)
class Claim:
    """A lease on one chunk; (owner, attempts) is the token that proves it is still ours."""

    epoch: int
    block: int
    chunk: int
    owner: str
    attempts: int

    @property
    def token(self) -> tuple:
        return (self.epoch, self.block, self.chunk, self.owner, self.attempts)


@dataclass(frozen=True)
class EpochStatus:
    epoch: int
    blocks_registered: int
    total_blocks: int | None
    open_chunks: int

    @property
    def complete(self) -> bool:
        return self.total_blocks is not None and self.blocks_registered >= self.total_blocks and self.open_chunks == 0


class ChunkTracker:
    """Shared SQL logic; subclasses set `url`, `now_sql`, `lock_sql` and implement `_tx`."""

    url: str
    now_sql: str
    lock_sql: str = ""
    placeholder: str = "?"

    def _tx(self, write: bool = True) -> AbstractContextManager[Any]:
        """A transaction yielding a cursor; maps driver errors to TrackerCorrupt/TrackerUnavailable."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> ChunkTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _q(self, sql: str) -> str:
        return sql.replace("{now}", self.now_sql).replace("{lock}", self.lock_sql).replace("?", self.placeholder)

    def _one(self, cur: Any, sql: str, params: tuple = ()) -> tuple | None:
        cur.execute(self._q(sql), params)
        return cur.fetchone()

    def _create_schema(self, cur: Any) -> None:
        for statement in SCHEMA:
            cur.execute(statement)

    # -- setup -------------------------------------------------------------------------------

    def setup(self, source: str, samples_per_block: int, chunk_size: int) -> None:
        """Create the tables, or check that an existing tracker was made for the same dataset (by name: the
        machines sharing a tracker may hold it in different folders) with the same blocking."""
        with self._tx() as cur:
            self._create_schema(cur)
            cur.execute(self._q("INSERT INTO shardstream_tracker (id, source, samples_per_block, chunk_size) "
                                "VALUES (1, ?, ?, ?) ON CONFLICT (id) DO NOTHING"), (source, samples_per_block, chunk_size))
            made, spb, cs = self._one(cur, "SELECT source, samples_per_block, chunk_size FROM shardstream_tracker WHERE id = 1")
        if dataset_name(made) != dataset_name(source):
            raise InvalidOption(f"tracker {self.url} was made for the dataset {made}, not {source}; pass that "
                                "--dataset-file (the same data, wherever it is on this machine) or use a new --tracker.")
        if (spb, cs) != (samples_per_block, chunk_size):
            raise InvalidOption(f"tracker {self.url} was made with {spb} samples per block and chunk size {cs}; "
                                "pass those values or use a new --tracker.")

    def is_empty(self) -> bool:
        with self._tx() as cur:
            self._create_schema(cur)
            return self._one(cur, "SELECT COUNT(*) FROM shardstream_chunks")[0] == 0

    # -- claiming ----------------------------------------------------------------------------

    def claim(self, owner: str, lease_seconds: float) -> Claim | None:
        """Lease the first expired, else the first pending, chunk of the current epoch, in one transaction.

        Two index-friendly lookups rather than one `OR`: with an `OR` the database walks every done
        chunk before the first free one, and claims slow down as the epoch fills.
        """
        with self._tx() as cur:
            for free in ("state = 'leased' AND lease_expires < {now}", "state = 'pending'"):
                row = self._one(cur, f"""
                    UPDATE shardstream_chunks SET state = 'leased', owner = ?, lease_expires = {{now}} + ?, attempts = attempts + 1
                    WHERE (epoch, block, chunk) = (
                        SELECT epoch, block, chunk FROM shardstream_chunks
                        WHERE epoch = (SELECT current_epoch FROM shardstream_tracker WHERE id = 1) AND {free}
                        ORDER BY block, chunk LIMIT 1 {{lock}})
                    RETURNING epoch, block, chunk, attempts""", (owner, lease_seconds))
                if row is not None:
                    return Claim(row[0], row[1], row[2], owner, row[3])
        return None

    def heartbeat(self, claim: Claim, lease_seconds: float, steps: int = 0) -> bool:
        """Extend the lease and count `steps`; False when the lease was lost to another worker."""
        with self._tx() as cur:
            self._add_steps(cur, steps)
            return self._one(cur, f"UPDATE shardstream_chunks SET lease_expires = {{now}} + ? WHERE {_OWNED} RETURNING 1",
                             (lease_seconds, *claim.token)) is not None

    def complete(self, claim: Claim, steps: int, samples: int) -> bool:
        """Record the chunk as trained (worker, global step, samples); False if the lease was lost."""
        with self._tx() as cur:
            step = self._add_steps(cur, steps)
            return self._one(cur, f"""
                UPDATE shardstream_chunks SET state = 'done', lease_expires = NULL, worker = owner, step = ?,
                    samples = ?, completed_at = {{now}}
                WHERE {_OWNED} RETURNING 1""", (step, samples, *claim.token)) is not None

    def release(self, claim: Claim, steps: int = 0) -> None:
        """Give an unfinished chunk back to the pool at once (a clean stop, not a crash)."""
        with self._tx() as cur:
            self._add_steps(cur, steps)
            cur.execute(self._q(f"UPDATE shardstream_chunks SET state = 'pending', owner = NULL, lease_expires = NULL WHERE {_OWNED}"),
                        claim.token)

    def _add_steps(self, cur: Any, steps: int) -> int:
        return self._one(cur, "UPDATE shardstream_tracker SET total_steps = total_steps + ? WHERE id = 1 RETURNING total_steps",
                         (steps,))[0]

    # -- blocks and epochs -------------------------------------------------------------------

    def register_block(self, block: int, chunks: int, is_last: bool) -> None:
        """Add a block's chunks to the current epoch (idempotent: many workers may race to do it)."""
        with self._tx() as cur:
            epoch = self._one(cur, "SELECT current_epoch FROM shardstream_tracker WHERE id = 1")[0]
            cur.executemany(self._q("INSERT INTO shardstream_chunks (epoch, block, chunk) VALUES (?, ?, ?) "
                                    "ON CONFLICT (epoch, block, chunk) DO NOTHING"),
                            [(epoch, block, c) for c in range(chunks)])
            if is_last:
                cur.execute(self._q("UPDATE shardstream_tracker SET total_blocks = ? WHERE id = 1"), (block + 1,))

    def epoch_status(self) -> EpochStatus:
        with self._tx(write=False) as cur:
            return self._status(cur)

    def _status(self, cur: Any) -> EpochStatus:
        """The current epoch's status in ONE statement, so one snapshot: read apart (PostgreSQL's
        READ COMMITTED snapshots each statement), a worker could see `total_blocks` still unknown
        but the last block already registered, and go looking for a block after the last."""
        return EpochStatus(*self._one(cur, """
            SELECT t.current_epoch, COUNT(DISTINCT c.block), t.total_blocks,
                   COALESCE(SUM(CASE WHEN c.state <> 'done' THEN 1 ELSE 0 END), 0)
            FROM shardstream_tracker t LEFT JOIN shardstream_chunks c ON c.epoch = t.current_epoch
            WHERE t.id = 1 GROUP BY t.current_epoch, t.total_blocks"""))

    def advance_epoch(self, from_epoch: int) -> None:
        """Start epoch `from_epoch + 1` with every chunk pending; a no-op if someone already did."""
        with self._tx() as cur:
            status = self._status(cur)
            epoch = status.epoch
            if not status.complete or epoch != from_epoch:
                return
            # Two workers may both see the epoch complete (PostgreSQL READ COMMITTED): the second's
            # statements then wait for the first's commit and change nothing.
            cur.execute(self._q("INSERT INTO shardstream_chunks (epoch, block, chunk) SELECT ?, block, chunk "
                                "FROM shardstream_chunks WHERE epoch = ? ON CONFLICT (epoch, block, chunk) DO NOTHING"),
                        (epoch + 1, epoch))
            cur.execute(self._q("UPDATE shardstream_tracker SET current_epoch = ? WHERE id = 1 AND current_epoch = ?"),
                        (epoch + 1, epoch))

    # -- inspection, export, import ----------------------------------------------------------

    def _meta(self, cur: Any) -> dict:
        row = self._one(cur, "SELECT source, samples_per_block, chunk_size, current_epoch, total_blocks, total_steps "
                             "FROM shardstream_tracker WHERE id = 1")
        if row is None:
            raise InvalidOption(f"tracker {self.url} is empty; start a training run with it first.")
        return dict(zip(("source", "samples_per_block", "chunk_size", "current_epoch", "total_blocks", "total_steps"), row))

    def _rows(self, cur: Any, where: str = "", params: tuple = ()) -> Iterator[dict]:
        cur.execute(self._q(f"SELECT {_CHUNK_COLUMNS} FROM shardstream_chunks {where} ORDER BY epoch, block, chunk"), params)
        names = _CHUNK_COLUMNS.split(", ")
        return (dict(zip(names, row)) for row in cur.fetchall())

    def get_progress_stats(self) -> dict:
        """Progress of the current epoch, overall and per worker, as plain JSON-able values."""
        with self._tx(write=False) as cur:
            self._create_schema(cur)
            meta = self._meta(cur)
            now = self._one(cur, "SELECT {now}")[0]
            rows = list(self._rows(cur, "WHERE epoch = ?", (meta["current_epoch"],)))
        return tracker_state.progress(meta, rows, now)

    def export_state(self) -> dict:
        """The whole tracker as a `chunk_tracker_state.json` document (see docs/TRAINING.md)."""
        with self._tx(write=False) as cur:
            self._create_schema(cur)
            meta = self._meta(cur)
            rows = list(self._rows(cur))
        return tracker_state.make_state(meta, rows, time.time())

    def import_state(self, state: dict) -> None:
        """Load an exported state into an empty tracker; live leases come back as pending chunks."""
        state = tracker_state.validate(state, "imported state")
        with self._tx() as cur:
            self._create_schema(cur)
            if self._one(cur, "SELECT COUNT(*) FROM shardstream_tracker")[0]:
                raise InvalidOption(f"tracker {self.url} already has data; import into a new --tracker.")
            cur.execute(self._q("INSERT INTO shardstream_tracker (id, source, samples_per_block, chunk_size, current_epoch, "
                                "total_blocks, total_steps) VALUES (1, ?, ?, ?, ?, ?, ?)"),
                        tuple(state[k] for k in ("source", "samples_per_block", "chunk_size", "current_epoch",
                                                 "total_blocks", "total_steps")))
            cur.executemany(self._q(f"INSERT INTO shardstream_chunks ({_CHUNK_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
                            [tracker_state.imported_row(row) for row in state["chunks"]])
