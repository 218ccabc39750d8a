"""Writing a store part by part, so that an interrupted run resumes where it stopped.

A part is written as one file, or, when its tensors come from several source shards that are
deleted as they go, as one file per shard ("pieces"). A file is streamed to a temp file (its
checksum computed on the way, the disk told to start writing at once), renamed into place and
recorded in the manifest, but neither is fsynced on its own: durability is batched (`sync`, one
fsync pass, then the manifest) before anything depends on it (a source shard's deletion, the final
`complete` commit). A file torn by a crash before then fails its checksum when the run is resumed
and is written again. Re-running keeps every file that still passes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from ..errors import InvalidOption
from ..atomic import discard_temp_files, fsync_paths, write_chunks_atomic, write_json_atomic
from .checksum import checksum_file
from .manifest import MANIFEST_NAME, FileRecord, Manifest, PartRecord, TensorRecord, load_manifest
from .partfile import EncodedPart, encode_part
from .span import FileSpan

PART_FILE = "weights.safetensors"


def write_encoded(path: Path, encoded: EncodedPart) -> str:
    """Write durably at once, read back, and return the checksum the file was verified against
    (for `shardstream shard`, which edits a finished store in place)."""
    digest = _stream_to(path, encoded, durable=True)
    if checksum_file(path) != digest:
        raise OSError(f"{path} reads back different from what was written; check the disk and re-run.")
    return digest


def _stream_to(path: Path, encoded: EncodedPart, durable: bool) -> str:
    """Write the part atomically, checksummed on the way; returns the checksum of what was written."""
    hasher = xxhash.xxh3_128()
    write_chunks_atomic(path, encoded.stream(hasher), durable=durable)
    return hasher.hexdigest()


def part_file(part: str, piece: int | None = None) -> str:
    """The file (relative to the store root) holding a part, or one piece of it."""
    return f"{part}/{PART_FILE}" if piece is None else f"{part}/weights-{piece:05d}.safetensors"


@dataclass
class WriteTimings:
    read_seconds: float   # reading source spans (streamed while writing)
    quantize_seconds: float
    write_seconds: float
    nbytes: int


class StoreWriter:
    def __init__(self, root: Path, manifest: Manifest):
        self.root = Path(root)
        self.manifest = manifest
        self._manifest_lock = threading.Lock()   # files are written in parallel, recorded one at a time
        self._unsynced: set[Path] = set()         # written (files and their folders), not yet fsynced

    @classmethod
    def open(cls, root: Path, fresh: Manifest) -> "StoreWriter":
        """Start a store, or resume one begun with the same settings, keeping only files that pass.

        Nothing on disk changes until `begin`: a repair that cannot proceed (its source shards are
        gone) must leave a finished store as usable as it was."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        discard_temp_files(root)
        if not (root / MANIFEST_NAME).exists():
            return cls(root, fresh)
        existing = load_manifest(root)
        mine = (fresh.config, fresh.compression, fresh.expected_parts)
        theirs = (existing.config, existing.compression, existing.expected_parts)
        if mine != theirs:
            raise InvalidOption(
                f"{root} already holds a store of another model or compression; choose another "
                "output folder or delete that one."
            )
        writer = cls(root, existing)
        writer._drop_invalid_files()
        return writer

    def begin(self) -> None:
        """Record the store as it is to be written (invalid files forgotten) and make every file it
        keeps durable: a killed run may not have synced them, and its shards may now be deleted."""
        self._sync_recorded()

    def _drop_invalid_files(self) -> None:
        """Forget (in memory) every recorded file that is missing or fails its checksum."""
        manifest = self.manifest
        bad = {name for name, record in manifest.files.items() if not self._file_matches(name, record)}
        if bad:
            manifest.files = {n: r for n, r in manifest.files.items() if n not in bad}
            manifest.tensors = {n: r for n, r in manifest.tensors.items() if r.file not in bad}
            manifest.parts = {p: r for p, r in manifest.parts.items() if not bad & set(r.files)}
            manifest.source_shards = {n: s for n, s in manifest.source_shards.items() if n not in bad}
            manifest.complete = False

    def _file_matches(self, name: str, record: FileRecord) -> bool:
        path = self.root / name
        return path.is_file() and path.stat().st_size == record.size and checksum_file(path) == record.xxh3_128

    def stored_tensors(self) -> set[str]:
        """Tensors already durably written (in complete parts or in pieces of incomplete ones)."""
        return set(self.manifest.tensors)

    def write(self, part: str, tensors: dict[str, torch.Tensor | FileSpan], experts: dict[str, int],
              piece: int | None, complete: bool, shards: list[str] | None = None) -> WriteTimings:
        """Encode, write atomically (checksummed on the way; fsync deferred to `sync`), record (with
        the source `shards` the tensors came from, which a repair of the file needs); mark the part
        complete when told."""
        started = time.perf_counter()
        encoded = encode_part(tensors, self.manifest.compression)
        name = part_file(part, piece)
        path = self.root / name
        digest = _stream_to(path, encoded, durable=False)
        with self._manifest_lock:
            self._unsynced.update((path, path.parent))
            self.manifest.files[name] = FileRecord(size=encoded.size, xxh3_128=digest)
            if shards:
                self.manifest.source_shards[name] = sorted(shards)
            for tensor_name, fields in encoded.records.items():
                self.manifest.tensors[tensor_name] = TensorRecord(
                    part=part, file=name, expert=experts.get(tensor_name), **fields
                )
            if complete:
                self._mark_complete(part)
            self.manifest.save(self.root, durable=False)   # made durable by `sync`, with the file
        elapsed = time.perf_counter() - started
        return WriteTimings(encoded.read_seconds, encoded.quantize_seconds,
                            elapsed - encoded.quantize_seconds - encoded.read_seconds, encoded.size)

    def _mark_complete(self, part: str) -> None:
        names = sorted(n for n, r in self.manifest.tensors.items() if r.part == part)
        files = sorted({self.manifest.tensors[n].file for n in names}) or [part_file(part)]
        nbytes = sum(self.manifest.files[f].size for f in files if f in self.manifest.files)
        self.manifest.parts[part] = PartRecord(files=files, tensors=names, nbytes=nbytes)

    def add_alias(self, name: str, target: str, part: str) -> None:
        """Record a tied tensor (e.g. the LM head that is the embedding) without storing it twice."""
        self.manifest.aliases[name] = {"target": target, "part": part}

    def sync(self) -> None:
        """Make every file written so far durable, in one fsync pass (data first, then folders),
        then the manifest that records them. Its fsync is deferred to here because under ext4's
        ordered mode it waits for all data in flight: once per part it would stall the writers."""
        with self._manifest_lock:
            paths, self._unsynced = self._unsynced, set()
        fsync_paths(sorted(p for p in paths if p.is_file()))
        fsync_paths(sorted(p for p in paths if p.is_dir()))
        with self._manifest_lock:
            body = self.manifest.to_dict()
        # outside the lock, so writers record on meanwhile; should one of their (newer) saves land
        # first, this one hides its records until the next save: a resume would rewrite those
        # files, whose shards are still there (a shard goes only after a `sync` that saw them)
        write_json_atomic(self.root / MANIFEST_NAME, body)

    def _sync_recorded(self) -> None:
        """`sync`, over every file the manifest records (also those an earlier run wrote)."""
        with self._manifest_lock:
            paths = [self.root / name for name in self.manifest.files]
            self._unsynced.update(paths + [p.parent for p in paths])
        self.sync()

    def finish(self) -> Manifest:
        """Commit: all files durable (those of an interrupted earlier run too), then `complete`."""
        missing = [p for p in self.manifest.expected_parts if p not in self.manifest.parts]
        assert not missing, f"finish() called with parts missing: {missing}"
        self._sync_recorded()
        self.manifest.complete = True
        self.manifest.save(self.root)
        return self.manifest
