"""What a store file that is not as its manifest says raises, worded once for every reader (copies,
mappings, O_DIRECT): one sentence naming the file and how to repair the store."""

from __future__ import annotations

from ..errors import StoreCorrupt, StoreIncomplete

REPAIR = "re-run `shardstream convert` to repair the store"


def missing(path) -> StoreIncomplete:
    return StoreIncomplete(f"{path} is missing; {REPAIR}.")


def wrong_size(path, size: int, expected: int) -> StoreCorrupt:
    return StoreCorrupt(f"{path} is {size} bytes but the manifest says {expected}; {REPAIR}.")


def shorter(path) -> StoreCorrupt:
    return StoreCorrupt(f"{path} is shorter than the manifest says; {REPAIR}.")


def fails_checksum(path) -> StoreCorrupt:
    return StoreCorrupt(f"{path} fails its checksum; {REPAIR}.")
