"""The store manifest: every part, file and tensor, with checksums, carrying its own checksum.

Plain JSON, sorted keys and no timestamps, so an interrupted-then-resumed conversion ends with the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import StoreCorrupt, StoreIncomplete, UntrustedPath
from ..atomic import write_json_atomic
from .checksum import checksum_bytes

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass
class FileRecord:
    size: int
    xxh3_128: str
    version: int = 1


@dataclass
class TensorRecord:
    """One tensor as stored: `dtype`/`shape` are what the file holds (packed bytes when quantized);
    `quant` says how to get the original back, including where its absmax scales sit."""

    part: str
    file: str
    dtype: str
    shape: list[int]
    offset: int
    length: int
    expert: int | None = None
    quant: dict | None = None

    @property
    def stored_bytes(self) -> int:
        """Its bytes in the file: a quantized tensor's codes and scales together."""
        return self.length + (self.quant["absmax"]["length"] if self.quant else 0)


@dataclass
class PartRecord:
    files: list[str]
    tensors: list[str]
    nbytes: int


@dataclass
class Manifest:
    source: str
    config: dict
    family: str
    compression: str | None
    expected_parts: list[str]
    format_version: int = FORMAT_VERSION
    parts: dict[str, PartRecord] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    aliases: dict[str, dict] = field(default_factory=dict)   # name -> {target, part}
    sharding: str | None = None   # the sharding index file (TP slices, experts by tier), when exported
    source_fingerprint: dict | None = None   # shard sizes and dates, or the Hub commit (sources.base.same_source)
    source_shards: dict[str, list[str]] = field(default_factory=dict)   # file -> the source shards it was made from
    complete: bool = False

    def to_dict(self) -> dict:
        return sealed(asdict(self))

    def save(self, root: Path, durable: bool = True) -> None:
        """Atomically; `durable=False` (no fsync) for progress records that a later durable save covers."""
        write_json_atomic(Path(root) / MANIFEST_NAME, self.to_dict(), durable)

    def ordered_parts(self) -> list[str]:
        """Written parts in model order (start, mid/0, ..., end)."""
        rank = {p: i for i, p in enumerate(self.expected_parts)}
        return sorted(self.parts, key=lambda p: (rank.get(p, len(rank)), p))

    @classmethod
    def from_dict(cls, body: dict, where: str) -> "Manifest":
        body = unsealed(body, where, "re-run `shardstream convert` to rebuild the store")
        version = body.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise StoreCorrupt(
                f"{where} has format version {version!r}, newer than this shardstream reads "
                f"({FORMAT_VERSION}); upgrade shardstream."
            )
        try:
            manifest = cls(**{k: v for k, v in body.items() if k not in _NESTED})
            manifest.parts = {k: PartRecord(**v) for k, v in body["parts"].items()}
            manifest.files = {k: FileRecord(**v) for k, v in body["files"].items()}
            manifest.tensors = {k: TensorRecord(**v) for k, v in body["tensors"].items()}
        except (TypeError, KeyError, AttributeError) as exc:
            raise StoreCorrupt(f"{where} has an unexpected layout ({exc}); re-run `shardstream convert`.") from None
        for name in manifest.files:
            check_relative(name, where)
        return manifest


_NESTED = {"parts", "files", "tensors"}


def sealed(body: dict) -> dict:
    """`body` plus the checksum of its canonical JSON: how the manifest and the sharding index
    protect themselves against edits and damage."""
    return {**body, "checksum": checksum_bytes(canonical_json(body))}


def unsealed(body: dict, where: str, remedy: str) -> dict:
    """`body` without its checksum, once the checksum is shown to match (the inverse of `sealed`)."""
    body = dict(body)
    if body.pop("checksum", None) != checksum_bytes(canonical_json(body)):
        raise StoreCorrupt(f"{where} fails its own checksum (edited or damaged); {remedy}.")
    return body


def canonical_json(body: dict) -> bytes:
    """The bytes a self-checksummed JSON file's checksum covers (sorted keys, no spaces)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def check_relative(name: str, where: str) -> str:
    """Refuse file names that would escape the folder they are relative to."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name or not name:
        raise UntrustedPath(f"{where} names the file {name!r}, which is outside its folder; refusing it.")
    return name


def load_manifest(root: Path) -> Manifest:
    path = Path(root) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StoreIncomplete(
            f"{path} does not exist; this is not a shardstream store (run `shardstream convert` first)."
        ) from None
    return Manifest.from_dict(json_object(raw, str(path), "re-run `shardstream convert` to rebuild it"), str(path))


def json_object(raw: bytes, where: str, remedy: str) -> dict:
    """`raw` parsed as a JSON object, or StoreCorrupt naming `where` and the `remedy`."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StoreCorrupt(f"{where} is not valid JSON; {remedy}.") from None
    if not isinstance(body, dict):
        raise StoreCorrupt(f"{where} is not a JSON object; {remedy}.")
    return body
