"""What a store file that is not as its manifest says raises, worded once for every reader (copies,
mappings, O_DIRECT): one sentence naming the file and how to repair the store.

Re-running the conversion repairs a store only while the source shards the file was made from
still exist; a `--sequential` or `--delete-original` conversion deletes them, and then the advice
names the shard to download again (the manifest records which shards made each file).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import ShardstreamError, StoreCorrupt, StoreIncomplete
from .manifest import MANIFEST_NAME, Manifest, load_manifest

REPAIR = "re-run `shardstream convert` to repair the store"
REMOTE_SOURCES = ("http://", "https://", "hf://")


def missing(path) -> StoreIncomplete:
    return StoreIncomplete(f"{path} is missing; {_advice(path)}.")


def wrong_size(path, size: int, expected: int) -> StoreCorrupt:
    return StoreCorrupt(f"{path} is {size} bytes but the manifest says {expected}; {_advice(path)}.")


def shorter(path) -> StoreCorrupt:
    return StoreCorrupt(f"{path} is shorter than the manifest says; {_advice(path)}.")


def fails_checksum(path) -> StoreCorrupt:
    return StoreCorrupt(f"{path} fails its checksum; {_advice(path)}.")


def repair(manifest: Manifest, files: Iterable[str]) -> str:
    """How to repair these store files (names relative to the store): re-run the conversion, or,
    when their source shards are gone from a local source, where to get them back first."""
    if manifest.source.startswith(REMOTE_SOURCES):
        return REPAIR   # downloaded again by the re-run
    recorded = (manifest.source_fingerprint or {}).get("shards", {})
    wanted = {s for f in files for s in manifest.source_shards.get(f, ())} or _not_converted(manifest, recorded)
    gone = sorted(s for s in wanted if not (Path(manifest.source) / s).is_file())
    return shards_gone(manifest.source, gone, recorded) if gone else REPAIR


def _not_converted(manifest: Manifest, recorded: dict[str, list[int]]) -> set[str]:
    """The source shards no written file came from: what an unfinished conversion still has to read (a
    --sequential one deleted the others once their parts were written)."""
    used = {s for shards in manifest.source_shards.values() for s in shards}
    return set(recorded) - used


def shards_gone(source: str, gone: list[str], recorded: dict[str, list[int]]) -> str:
    """The advice for a repair whose source shards `gone` are no longer in the local folder `source`;
    `recorded` is the store's fingerprint of them ([size, mtime_ns] by shard): a shard downloaded
    again is taken as the same only with its recorded date, which the advice says how to give it."""
    folder = Path(source)
    if not folder.is_dir():
        return (f"its source folder {source} is gone (--delete-original removes it), so download the checkpoint "
                f"again (this needs {', '.join(gone)}) and convert it into a new folder, or restore the store "
                "from a copy")
    date = ""
    if gone[0] in recorded:
        seconds, nanoseconds = divmod(recorded[gone[0]][1], 10**9)
        date = (f", give each its recorded date (`touch -d @{seconds}.{nanoseconds:09d} {folder / gone[0]}`: "
                "the store knows its source by shard sizes and dates)")
    return (f"the source shards it needs ({', '.join(gone)}) are no longer in {source} (a --sequential "
            f"conversion deletes the shards it used), so download them again into that folder from where the "
            f"checkpoint came from{date} and re-run `shardstream convert`, or restore the store from a copy")


def _advice(path) -> str:
    """`repair` for one file, found from its path (the store is the nearest folder above with a
    manifest); the plain advice where no readable manifest is found (a tier outside the store)."""
    path = Path(path)
    for folder in path.parents:
        if (folder / MANIFEST_NAME).is_file():
            try:
                return repair(load_manifest(folder), [path.relative_to(folder).as_posix()])
            except (ShardstreamError, OSError):
                return REPAIR
    return REPAIR
