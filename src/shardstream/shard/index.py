"""The sharding index, `<store>/sharding.json`: where every TP slice and placed expert lives.

It sits beside the manifest (which the converter owns) and, like it, carries its own checksum and
is only ever replaced atomically, so an interrupted `shard` or `relocate` leaves the old index or
the new one, never a mix. Files it names are checked against its checksums before use.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import StoreCorrupt, StoreIncomplete
from ..atomic import write_json_atomic
from ..store.checksum import checksum_bytes
from ..store.manifest import FORMAT_VERSION, FileRecord, canonical_json, check_relative, load_manifest, sealed, unsealed
from ..store.reader import Store
from ..store.remote import RemoteStore

INDEX_NAME = "sharding.json"


@dataclass
class SliceRecord:
    """One rank's slice of one tensor; `split_dim` is None for a replicated tensor."""

    tensor: str
    part: str
    rank: int
    count: int
    shape: list[int]
    dtype: str
    split_dim: int | None
    file: str
    offset: int
    length: int


@dataclass
class ExpertRecord:
    """One expert's file: `file` is relative to its tier's root; `hint` is its tier's speed order."""

    tier: str
    group: int
    expert: int
    file: str
    hint: int
    tensors: dict[str, dict]   # name -> {dtype, shape, offset, length}


@dataclass
class ShardIndex:
    tiers: dict[str, dict] = field(default_factory=dict)   # name -> {root (relative = in the store), hint}
    slices: list[SliceRecord] = field(default_factory=list)
    experts: dict[str, ExpertRecord] = field(default_factory=dict)  # "<group>:<expert>" -> record
    files: dict[str, FileRecord] = field(default_factory=dict)     # every TP and expert file (expert paths name their tier)
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        """The self-checksummed index, e.g. for a pipeline stage's own copy."""
        return canonical_json(sealed(asdict(self)))

    def save(self, root: Path) -> None:
        write_json_atomic(Path(root) / INDEX_NAME, sealed(asdict(self)))
        manifest = load_manifest(root)
        if manifest.sharding != INDEX_NAME:   # first export: the manifest points at the index
            manifest.sharding = INDEX_NAME
            manifest.save(root)

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "ShardIndex":
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise StoreCorrupt(f"{where} is not a sharding index; re-run `shardstream shard`.") from None
        if not isinstance(body, dict):
            raise StoreCorrupt(f"{where} is not a sharding index; re-run `shardstream shard`.")
        body = unsealed(body, where, "re-run `shardstream shard`")
        if body.get("format_version", 1) > FORMAT_VERSION:
            raise StoreCorrupt(f"{where} was written by a newer shardstream; upgrade shardstream.")
        index = cls(tiers=body["tiers"], format_version=body.get("format_version", 1))
        index.slices = [SliceRecord(**s) for s in body["slices"]]
        index.experts = {k: ExpertRecord(**e) for k, e in body["experts"].items()}
        index.files = {k: FileRecord(**f) for k, f in body["files"].items()}
        for tier in index.tiers.values():
            if not Path(tier["root"]).is_absolute():
                check_relative(tier["root"], where)
        for record in index.slices:
            check_relative(record.file, where)
        for record in index.experts.values():
            check_relative(record.file, where)
        return index


def load_index(store: Store, for_update: bool = False) -> ShardIndex:
    """The store's sharding index, or an empty one when the store was never sharded.

    Readers share one parsed copy per version of the file (parsing costs milliseconds, on every
    rank or expert load otherwise); a caller that will change and save the index passes
    `for_update` and gets its own copy.
    """
    version = _index_version(store)
    cached = getattr(store, "_sharding_index", None)
    if not for_update and cached is not None and cached[0] == version:
        return cached[1]
    try:
        raw = read_store_file(store, INDEX_NAME)
    except StoreIncomplete:
        return ShardIndex()
    index = ShardIndex.from_bytes(raw, f"{store.root}/{INDEX_NAME}")
    if not for_update:
        store._sharding_index = (version, index)
    return index


def _index_version(store: Store) -> tuple[int, int, int] | None:
    """Identity of a local index file (every save is a new inode); None for a remote store,
    whose index is read once per open."""
    if isinstance(store, RemoteStore):
        return None
    try:
        stat = (Path(store.root) / INDEX_NAME).stat()
    except FileNotFoundError:
        return (-1, -1, -1)
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def read_store_file(store: Store, name: str, offset: int = 0, length: int | None = None) -> bytearray:
    """Raw bytes of a file under the store root, local or remote (no checksum: callers check)."""
    if isinstance(store, RemoteStore):
        return bytearray(store.read_bytes(name, offset, length))
    return read_path(Path(store.root) / name, offset, length)


def read_path(path: Path, offset: int = 0, length: int | None = None) -> bytearray:
    """A local file's bytes in a writable buffer that tensors can view without another copy."""
    try:
        with open(path, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size - offset if length is None else length
            data = bytearray(max(size, 0))
            handle.seek(offset)
            got = handle.readinto(data)
    except FileNotFoundError:
        raise StoreIncomplete(f"{path} is missing; run `shardstream verify`, then `shardstream shard` to rewrite it.") from None
    return data[:got] if got < len(data) else data


def checked(data: bytes, record: FileRecord, where: str) -> bytes:
    """`data` if it matches its index record; a corrupt file is named and never used."""
    if len(data) != record.size or checksum_bytes(data) != record.xxh3_128:
        raise StoreCorrupt(f"{where} fails its checksum; run `shardstream shard` again to rewrite it.")
    return data
