"""The sharding index, `<store>/sharding.json`: where every TP slice and placed expert lives.

It sits beside the manifest (which the converter owns) and, like it, carries its own checksum and
is only ever replaced atomically, so an interrupted `shard` or `relocate` leaves the old index or
the new one, never a mix. Files it names are checked against its checksums before use.

A placed expert is stored apart: once `shardstream shard --experts` has finished, its tensors are
in its tier's container for its block only, and `Store.load("mid/<l>")` reads them from there (see
`Expert`): one read of its own bytes, checked against its own checksum.

A rank's TP slices are read as a store of their own (`rank_view`): `Store.load(part, tp_rank=, tp_size=)`
loads a part of it, and a tensor-parallel rank streams it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Protocol

import torch

from ..errors import InvalidOption, PartNotFound, StoreCorrupt, StoreIncomplete
from ..atomic import write_json_atomic
from ..quant import QuantizedTensor
from .checksum import HashAsRead, checksum_bytes
from .direct_io import ALIGN, DirectUnsupported, Stoppable, aligned, open_file, read_at
from .manifest import FileRecord, Manifest, PartRecord, TensorRecord, canonical_json, check_relative, json_object, sealed, unsealed
from .partfile import decode_tensor

READ_CHUNK = 64 << 20   # an expert read in pieces of this size (Expert.fill)


class StoreFiles(Protocol):
    """What the index needs of a store (a local `reader.Store` or a `remote.RemoteStore`); named
    here so that the reader, which loads experts and slices through this module, is not imported."""

    root: Path | str
    manifest: Manifest
    remote: bool

    def file_version(self, name: str) -> object: ...

    def read_raw(self, name: str, offset: int = 0, length: int | None = None) -> bytearray: ...

    def view(self, manifest: Manifest) -> "StoreFiles": ...

    def load(self, part: str, device: str | torch.device = "cpu", *, read: Callable[[str], bytearray] | None = None,
             tied: bool = True) -> dict[str, torch.Tensor]: ...


INDEX_NAME = "sharding.json"
# 2: slices record `ranges` and `quant` (tensor-parallel shares). 3: experts sit in containers, one per tier
# and block, and record `offset`, `length` and their own `xxh3_128`. Older indexes are read as they are (an
# expert record without them is its whole file); a shardstream that reads only an older version refuses a
# newer index with a sentence instead of a traceback.
INDEX_VERSION = 3


@dataclass
class SliceRecord:
    """One rank's slice of one tensor; `split_dim` is None for a replicated tensor. `ranges`: the
    [start, stop) ranges along `split_dim` the slice concatenates (a tensor-parallel rank's share:
    heads and halves of fused projections, replicated KV heads); None in slices older versions
    wrote, which are one equal block each. `quant`: the codes' quantization (as in the manifest), when
    the slice was kept quantized."""

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
    ranges: list[list[int]] | None = None
    quant: dict | None = None


@dataclass
class ExpertRecord:
    """One expert's bytes: [offset, offset + length) of `file` (its container, relative to its tier's
    root; in indexes before version 3 a file of its own), checksummed alone by `xxh3_128`; `hint` is its
    tier's speed order."""

    tier: str
    group: int
    expert: int
    file: str
    hint: int
    tensors: dict[str, dict]   # name -> {dtype, shape, offset (from the expert's first byte), length[, quant]}
    offset: int = 0
    length: int = 0
    xxh3_128: str = ""

    @property
    def key(self) -> str:
        return f"{self.group}:{self.expert}"

    @property
    def span(self) -> FileRecord:
        """The expert's bytes as a file record (their size and checksum)."""
        return FileRecord(size=self.length, xxh3_128=self.xxh3_128)


@dataclass
class ShardIndex:
    tiers: dict[str, dict] = field(default_factory=dict)   # name -> {root (relative = in the store), hint}
    slices: list[SliceRecord] = field(default_factory=list)
    experts: dict[str, ExpertRecord] = field(default_factory=dict)  # "<group>:<expert>" -> record
    files: dict[str, FileRecord] = field(default_factory=dict)     # every TP and expert file (expert paths name their tier)
    parts: dict[str, str] = field(default_factory=dict)   # part -> tier holding its files (same names, under the tier root)
    format_version: int = INDEX_VERSION

    def to_bytes(self) -> bytes:
        """The self-checksummed index, e.g. for a pipeline stage's own copy."""
        return canonical_json(sealed(asdict(self)))

    def save(self, store: StoreFiles) -> None:
        """Replace the store's index atomically (as this version writes it); the first save also points its
        manifest at it."""
        self.format_version = INDEX_VERSION
        write_json_atomic(Path(store.root) / INDEX_NAME, sealed(asdict(self)))
        if store.manifest.sharding != INDEX_NAME:
            store.manifest.sharding = INDEX_NAME
            store.manifest.save(store.root)

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "ShardIndex":
        body = unsealed(json_object(raw, where, "re-run `shardstream shard`"), where, "re-run `shardstream shard`")
        if body.get("format_version", 1) > INDEX_VERSION:
            raise StoreCorrupt(f"{where} was written by a newer shardstream; upgrade shardstream.")
        index = cls(tiers=body["tiers"], format_version=body.get("format_version", 1))
        index.slices = [SliceRecord(**s) for s in body["slices"]]
        index.experts = {k: ExpertRecord(**e) for k, e in body["experts"].items()}
        index.files = {k: FileRecord(**f) for k, f in body["files"].items()}
        for record in index.experts.values():
            if not record.xxh3_128:   # written before containers: the expert is its whole file
                whole = index.files[record.file]
                record.offset, record.length, record.xxh3_128 = 0, whole.size, whole.xxh3_128
        index.parts = dict(body.get("parts", {}))
        for tier in index.tiers.values():
            if not Path(tier["root"]).is_absolute():
                check_relative(tier["root"], where)
        for record in index.slices:
            check_relative(record.file, where)
        for record in index.experts.values():
            check_relative(record.file, where)
        return index


def load_index(store: StoreFiles, for_update: bool = False) -> ShardIndex:
    """The store's sharding index, or an empty one when the store was never sharded.

    Readers share one parsed copy per version of the file (parsing costs milliseconds, on every
    rank or expert load otherwise); a caller that will change and save the index passes
    `for_update` and gets its own copy.
    """
    version = store.file_version(INDEX_NAME)
    cached = getattr(store, "_sharding_index", None)
    if not for_update and cached is not None and cached[0] == version:
        return cached[1]
    try:
        raw = store.read_raw(INDEX_NAME)
    except StoreIncomplete:
        return ShardIndex()
    index = ShardIndex.from_bytes(raw, f"{store.root}/{INDEX_NAME}")
    if not for_update:
        store._sharding_index = (version, index)
    return index


def _missing(path: Path) -> StoreIncomplete:
    return StoreIncomplete(f"{path} is missing; run `shardstream verify` to see what else is, and restore it.")


def read_path(path: Path, offset: int = 0, length: int | None = None) -> bytearray:
    """A local file's bytes in a writable buffer that tensors can view without another copy."""
    try:
        with open(path, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size - offset if length is None else length
            data = bytearray(max(size, 0))
            handle.seek(offset)
            got = handle.readinto(data)
    except FileNotFoundError:
        raise _missing(path) from None
    return data[:got] if got < len(data) else data


def _read_plain(path: Path, view: memoryview, offset: int, drop: bool, stop: Stoppable | None = None,
                landed: Callable[[int], None] | None = None) -> int:
    """Read the file from `offset` into `view` in READ_CHUNK pieces (or as `stop` says: `Stoppable`), each
    one's pages dropped from the page cache when `drop` and `landed` told the bytes read so far; returns the
    bytes read."""
    with open(path, "rb", buffering=0) as handle:
        handle.seek(offset)
        done = 0
        while done < len(view):
            piece = READ_CHUNK if stop is None else stop.piece(READ_CHUNK, done)
            got = handle.readinto(view[done:done + piece])
            if not got:
                break
            if drop:
                os.posix_fadvise(handle.fileno(), offset + done, got, os.POSIX_FADV_DONTNEED)
            done += got
            if landed is not None:
                landed(done)
    return done


def _read_direct(path: Path, buffer, offset: int, size: int, stop: Stoppable | None = None,
                 landed: Callable[[int], None] | None = None) -> int | None:
    """Read the file's `size` bytes at `offset` (aligned) into `buffer` with O_DIRECT (stoppable, each piece
    `landed`: read_at); None where that cannot be (no O_DIRECT on this system or filesystem, a buffer not
    page-aligned or too short for the page-rounded size)."""
    view = memoryview(buffer)[:aligned(size)]
    if not hasattr(os, "O_DIRECT") or len(view) < aligned(size) or offset % ALIGN:
        return None
    try:
        fd = open_file(path)
    except DirectUnsupported:
        return None
    try:
        return min(read_at(fd, path, view, offset, stop, landed), size)
    except DirectUnsupported:   # the buffer's address is not aligned, or the read was refused
        return None
    finally:
        os.close(fd)


def checked(data: bytes, record: FileRecord, where: str) -> bytes:
    """`data` if it matches its index record; a corrupt file (or expert) is named and never used."""
    if len(data) != record.size or checksum_bytes(data) != record.xxh3_128:
        raise _corrupt(where)
    return data


def _corrupt(where: str) -> StoreCorrupt:
    return StoreCorrupt(
        f"{where} fails its checksum and is not used; rewrite a TP slice with `shardstream shard --tp`, "
        "restore an expert container from a backup (or rebuild: `shardstream convert`, then `shard --experts`)."
    )


def tier_root(store: StoreFiles, index: ShardIndex, tier: str) -> Path:
    """A tier's folder: absolute (another disk), or relative to the store root."""
    root = Path(index.tiers[tier]["root"])
    return root if root.is_absolute() else Path(store.root) / root


def placed_in(store: StoreFiles, layer: int) -> list[ExpertRecord]:
    """The experts of block `layer` stored apart on tiers (none for a store never sharded)."""
    if not store.manifest.sharding:
        return []
    return [r for r in load_index(store).experts.values() if r.group == layer]


class Expert:
    """One placed expert; its bytes are read and checksum-verified on first use of `tensors`."""

    def __init__(self, store: StoreFiles, index: ShardIndex, record: ExpertRecord):
        self.store, self.index, self.record = store, index, record

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.read(verify=True)

    def read(self, verify: bool, dequantize: bool = True) -> dict[str, torch.Tensor | QuantizedTensor]:
        """The expert's tensors from a fresh read (quantized ones dequantized, or as codes and scales when not
        `dequantize`); checked against the index when `verify`."""
        return self._decode(self.contents(verify), dequantize)

    def _decode(self, data, dequantize: bool = True) -> dict[str, torch.Tensor | QuantizedTensor]:
        """The expert's tensors from its bytes: views of them where stored plainly, else dequantized
        (or, not `dequantize`, their codes and scales viewing the bytes)."""
        return {n: decode_tensor(data, 0, TensorRecord(part="", file=self.record.file, **r), dequantize)
                for n, r in self.record.tensors.items()}

    @property
    def nbytes(self) -> int:
        """The expert's bytes in its container: what one read of it fetches."""
        return self.record.length

    def where(self) -> str:
        """Its container and its key, e.g. `experts/tier_hot/group_0.1.experts (expert 0:3)`."""
        file = PurePosixPath(self.index.tiers[self.record.tier]["root"]) / self.record.file
        return f"{file} (expert {self.record.key})"

    def contents(self, verify: bool) -> bytearray:
        """The expert's bytes, checked against the index when `verify` (else only their length)."""
        data = self.raw()
        if verify:
            checked(data, self.record.span, self.where())
        else:
            self._check_length(len(data))
        return data

    def _check_length(self, size: int) -> None:
        if size != self.record.length:
            raise StoreCorrupt(f"{self.where()} is {size} bytes, not the {self.record.length} its index says; "
                               "run `shardstream verify --parts experts`.")

    @property
    def path(self) -> Path | None:
        """The file on this machine (its tier's root may be outside the store); None in a remote store."""
        return None if self.store.remote else tier_root(self.store, self.index, self.record.tier) / self.record.file

    def fill(self, buffer, drop: bool = False, stop: Stoppable | None = None,
             verify: bool = True) -> tuple[int, HashAsRead | None]:
        """Read the expert's bytes into `buffer` (a writable buffer of at least `nbytes`: reused, it costs no
        page faults), unchecked (`tensors_in` checks them): the bytes read, and (`verify`) their checksum, made
        piece by piece as they land (`HashAsRead`), else None.

        `drop` (the experts outgrow memory, so every one is read again anyway, and under a cap that counts
        the page cache kept pages are reclaim to pay for): past the page cache, with O_DIRECT when `buffer`
        is page-aligned and of the expert's page-rounded size (stream/direct.py's read buffers: huge pages,
        no copy on the CPU; containers align every expert for it), else in READ_CHUNK pieces each dropped
        from the page cache once read. `stop`: a read that may be stopped halfway (a read ahead of the router,
        `Stoppable`)."""
        record = self.record
        view = memoryview(buffer)[:record.length]
        hashing = HashAsRead(view) if verify else None
        try:
            done = _read_direct(self.path, buffer, record.offset, record.length, stop,
                                hashing and hashing.landed) if drop else None
            if done is None:   # no O_DIRECT here: read again from the start, hashed again
                if hashing is not None:
                    hashing.close()
                    hashing = HashAsRead(view)
                done = _read_plain(self.path, view, record.offset, drop, stop, hashing and hashing.landed)
        except BaseException as error:
            if hashing is not None:
                hashing.close()
            if isinstance(error, FileNotFoundError):
                raise _missing(self.path) from None
            raise
        return done, hashing

    def tensors_in(self, buffer, done: int, hashing: HashAsRead | None,
                   dequantize: bool = True) -> dict[str, torch.Tensor | QuantizedTensor]:
        """The expert's tensors viewing `buffer` that `fill` read `done` bytes into, `hashing` them (where
        stored plainly; else dequantized, or as codes and scales when not `dequantize`), once they pass its
        checksum; a read made without one (`hashing` None) is checked by its length only."""
        if hashing is None:
            self._check_length(done)
        else:
            digest = hashing.hexdigest()   # asked first: it also waits for the hashing thread to end
            if done != self.record.span.size or digest != self.record.span.xxh3_128:
                raise _corrupt(self.where())
        return self._decode(memoryview(buffer)[:self.record.length], dequantize)

    def raw(self) -> bytearray:
        """The expert's bytes (one read at its offset in its container), unchecked."""
        record = self.record
        root = self.index.tiers[record.tier]["root"]
        if not Path(root).is_absolute():
            return self.store.read_raw(str(PurePosixPath(root) / record.file), record.offset, record.length)
        if self.store.remote:
            raise InvalidOption(
                f"expert {record.key} is on tier {record.tier!r} at {root}, outside the store; "
                "relocate it to a tier inside the store to serve it over HTTP."
            )
        return read_path(Path(root) / record.file, record.offset, record.length)


def load_expert(store: StoreFiles, layer: int, expert: int) -> Expert:
    index = load_index(store)
    return Expert(store, index, expert_record(store, index, layer, expert))


def expert_record(store: StoreFiles, index: ShardIndex, layer: int, expert: int) -> ExpertRecord:
    try:
        return index.experts[f"{layer}:{expert}"]
    except KeyError:
        raise PartNotFound(
            f"{store.root}/{INDEX_NAME} places no expert {layer}:{expert}; run `shardstream shard {store.root} --experts` first."
        ) from None


def rank_view(store: StoreFiles, tp_rank: int, tp_size: int, tensors: Collection[str] | None = None) -> StoreFiles:
    """Rank `tp_rank` of `tp_size`'s exported slices (`shardstream shard --tp`) as a store of their own: the
    same files, read through a manifest (in memory) whose tensors are the rank's slices (those in `tensors`,
    when given) and whose parts are the rank's files. The one reader of exported slices: `load_tp` loads a
    part of it, and a tensor-parallel rank streams it as any store (tp/rankstore.py)."""
    index = load_index(store)
    source = store.manifest
    manifest = Manifest(source=str(store.root), config=source.config, family=source.family,
                        compression=source.compression, expected_parts=list(source.expected_parts),
                        aliases=dict(source.aliases), complete=True)
    for record in index.slices:
        if record.rank != tp_rank or record.count != tp_size or (tensors is not None and record.tensor not in tensors):
            continue
        manifest.tensors[record.tensor] = slice_tensor_record(record)
        manifest.files[record.file] = index.files[record.file]
        part = manifest.parts.setdefault(record.part, PartRecord(files=[], tensors=[], nbytes=0))
        part.tensors.append(record.tensor)
        if record.file not in part.files:
            part.files.append(record.file)
    for part in manifest.parts.values():
        part.nbytes = sum(manifest.files[f].size for f in part.files)
    return store.view(manifest)


def load_tp(store: StoreFiles, part: str, tp_rank: int, tp_size: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s slices of one part (written by `shardstream shard --tp`): reads that
    rank's file, checksum-verified against the index, and nothing else of the part (a tied head is the
    start's embedding slice, not read again here). MoE experts are not sliced."""
    if not 0 <= tp_rank < tp_size:
        raise InvalidOption(f"tp_rank must be in [0, tp_size), not {tp_rank} of {tp_size}.")
    view = rank_view(store, tp_rank, tp_size)
    if part not in view.manifest.parts:
        raise StoreIncomplete(
            f"{store.root} has no rank {tp_rank} of {tp_size} slices for {part!r}; run "
            f"`shardstream shard {store.root} --tp {tp_size}` first."
        )
    files = view.manifest.files
    return view.load(part, device, tied=False,
                     read=lambda name: checked(store.read_raw(name), files[name], f"{store.root}/{name}"))


def slice_tensor_record(record: SliceRecord) -> TensorRecord:
    """The slice as a manifest tensor record (its part, file, bytes and quantization)."""
    return TensorRecord(part=record.part, file=record.file, dtype=record.dtype, shape=record.shape,
                        offset=record.offset, length=record.length, quant=record.quant)
