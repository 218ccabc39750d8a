"""`chunk_tracker_state.json`: the tracker as one plain document, and progress derived from rows.

The file is how a run's data position travels with its checkpoint and how a person inspects it;
its schema is documented in docs/TRAINING.md. Import trusts nothing: every field is checked before
any row is written.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from shardstream.atomic import write_bytes_atomic
from shardstream.errors import TrackerCorrupt

STATE_FORMAT = "shardstream.chunk_tracker_state"
STATE_VERSION = 1
STATE_FILENAME = "chunk_tracker_state.json"
STATES = ("pending", "leased", "done")
_META_FIELDS = {"source": str, "samples_per_block": int, "chunk_size": int, "current_epoch": int,
                "total_blocks": (int, type(None)), "total_steps": int}
_ROW_FIELDS = {"epoch": int, "block": int, "chunk": int, "state": str, "owner": (str, type(None)),
               "lease_expires": (float, int, type(None)), "attempts": int, "worker": (str, type(None)),
               "step": (int, type(None)), "samples": (int, type(None)), "completed_at": (float, int, type(None))}


def make_state(meta: dict, rows: list[dict], exported_at: float) -> dict:
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "exported_at": exported_at, **meta, "chunks": rows}


def _check_fields(obj: object, fields: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise TrackerCorrupt(f"{where} must be a JSON object; re-export it with `shardstream data export`.")
    for name, kind in fields.items():
        value = obj.get(name, ...)
        if value is ... or not isinstance(value, kind) or isinstance(value, bool):
            raise TrackerCorrupt(f"{where} field {name!r} is missing or has the wrong type; re-export it with `shardstream data export`.")


def validate(state: object, where: str) -> dict:
    """Check the whole document (format, version, every field, no duplicate keys) or raise."""
    _check_fields(state, {"format": str, "version": int, "chunks": list, **_META_FIELDS}, where)
    if state["format"] != STATE_FORMAT or state["version"] != STATE_VERSION:
        raise TrackerCorrupt(f"{where} is not a version {STATE_VERSION} {STATE_FORMAT} document; export it again with this shardstream.")
    seen = set()
    for i, row in enumerate(state["chunks"]):
        _check_fields(row, _ROW_FIELDS, f"{where} chunks[{i}]")
        key = (row["epoch"], row["block"], row["chunk"])
        if row["state"] not in STATES or key in seen or min(key) < 0 or row["epoch"] > state["current_epoch"]:
            raise TrackerCorrupt(f"{where} chunks[{i}] has a bad state, a negative or future key, or repeats {key}; fix or re-export it.")
        seen.add(key)
    return state


def imported_row(row: dict) -> tuple:
    """A row ready to insert: leases do not survive export, so a leased chunk is pending again."""
    if row["state"] == "leased":
        row = {**row, "state": "pending", "owner": None, "lease_expires": None}
    return tuple(row[name] for name in _ROW_FIELDS)


def write_state(path: Path, state: dict) -> None:
    write_bytes_atomic(Path(path), (json.dumps(state, indent=1) + "\n").encode())


def read_state(path: Path) -> dict:
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrackerCorrupt(f"tracker state file {path} cannot be read ({e}); restore it from a checkpoint or start without it.") from None
    return validate(state, f"tracker state file {path}")


def progress(meta: dict, rows: list[dict], now: float) -> dict:
    """Counts for the current epoch's rows, plus per-worker totals and live leases."""
    counts = {s: 0 for s in STATES}
    blocks: dict[int, bool] = {}
    workers: dict[str, dict] = defaultdict(lambda: {"chunks_done": 0, "samples": 0, "last_step": None, "leased": []})
    expired = 0
    for row in rows:
        counts[row["state"]] += 1
        blocks[row["block"]] = blocks.get(row["block"], True) and row["state"] == "done"
        if row["state"] == "done":
            w = workers[row["worker"]]
            w["chunks_done"] += 1
            w["samples"] += row["samples"] or 0
            w["last_step"] = max(w["last_step"] or 0, row["step"] or 0)
        elif row["state"] == "leased":
            workers[row["owner"]]["leased"].append([row["block"], row["chunk"]])
            expired += row["lease_expires"] is not None and row["lease_expires"] < now
    total = meta["total_blocks"]
    return {
        **meta,
        "blocks_registered": len(blocks),
        "blocks_this_epoch": sum(blocks.values()),
        "chunks_total": len(rows),
        "chunks_done": counts["done"],
        "chunks_leased": counts["leased"],
        "chunks_expired": expired,
        "chunks_pending": counts["pending"],
        "samples_this_epoch": sum(row["samples"] or 0 for row in rows if row["state"] == "done"),
        "epoch_complete": total is not None and len(blocks) >= total and counts["done"] == len(rows),
        "workers": dict(sorted(workers.items())),
    }
