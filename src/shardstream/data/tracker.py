"""Open a chunk tracker from what the user typed: a file path, a sqlite:// URL or a postgresql:// URL.

The shared SQL lives in `tracker_base.py`, each backend in its own module; this module only picks
one, so nothing here is imported back by the backends.

SQLite URLs follow SQLAlchemy: `sqlite:///rel/t.sqlite` is relative to the current directory
(three slashes, then the path), `sqlite:////abs/t.sqlite` is absolute (four slashes). Any other
`sqlite:` form (`sqlite://host/...`, an in-memory `sqlite://`) is refused.
"""

from __future__ import annotations

from pathlib import Path

from shardstream.data.tracker_base import ChunkTracker, Claim, EpochStatus
from shardstream.errors import InvalidOption, TrackerNotFound

__all__ = ["ChunkTracker", "Claim", "EpochStatus", "open_tracker", "sqlite_path"]


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite tracker URL or plain path names; None for a PostgreSQL URL."""
    if url.startswith(("postgresql://", "postgres://")):
        return None
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///") or url == "sqlite:///":
            raise InvalidOption(f"tracker {url!r} is not a SQLite file URL; write sqlite:///relative/path or sqlite:////absolute/path.")
        return Path(url.removeprefix("sqlite:///"))
    if "://" in url:
        raise InvalidOption(f"tracker {url!r} has an unknown scheme; use a file path, sqlite:///path or postgresql://...")
    return Path(url)


def open_tracker(url: str, must_exist: bool = False) -> ChunkTracker:
    """`postgresql://...` opens PostgreSQL; `sqlite:///path` or a plain path opens SQLite.

    With `must_exist` (commands that only read a tracker) a missing SQLite file is an error, not a new tracker.
    """
    path = sqlite_path(url)
    if path is None:
        from shardstream.data.tracker_postgres import PostgresTracker

        return PostgresTracker(url)
    if path.is_dir():
        raise TrackerNotFound(f"tracker {path.resolve()} is a folder; pass its SQLite file (a training run's is "
                              f"{path / 'chunk_tracker.sqlite'}).")
    if must_exist and not path.is_file():
        raise TrackerNotFound(f"tracker {path.resolve()} does not exist; pass the --tracker a training run used "
                              "(by default OUTPUT/chunk_tracker.sqlite).")
    from shardstream.data.tracker_sqlite import SqliteTracker

    return SqliteTracker(path)
