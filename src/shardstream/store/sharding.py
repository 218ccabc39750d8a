"""The sharding index, `<store>/sharding.json`: where every TP slice and placed expert lives.

It sits beside the manifest (which the converter owns) and, like it, carries its own checksum and
is only ever replaced atomically, so an interrupted `shard` or `relocate` leaves the old index or
the new one, never a mix. Files it names are checked against its checksums before use.

A placed expert is stored apart: once `shardstream shard --experts` has finished, its tensors are
in its tier file only, and `Store.load("mid/<l>")` reads them from there (see `Expert`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Protocol

import torch

from ..errors import InvalidOption, PartNotFound, StoreCorrupt, StoreIncomplete
from ..atomic import write_json_atomic
from ..quant import QuantizedTensor
from .checksum import checksum_bytes
from .direct_io import DirectUnsupported, aligned, open_file, read_at
from .manifest import FileRecord, Manifest, TensorRecord, canonical_json, check_relative, json_object, sealed, unsealed
from .partfile import decode_tensor

READ_CHUNK = 64 << 20   # an expert file read in pieces of this size (Expert.read_into)


class StoreFiles(Protocol):
    """What the index needs of a store (a local `reader.Store` or a `remote.RemoteStore`); named
    here so that the reader, which loads experts and slices through this module, is not imported."""

    root: Path | str
    manifest: Manifest
    remote: bool

    def file_version(self, name: str) -> object: ...

    def read_raw(self, name: str, offset: int = 0, length: int | None = None) -> bytearray: ...


INDEX_NAME = "sharding.json"
# 2: slices record `ranges` and `quant` (tensor-parallel shares). Version 1 indexes are read as they are; a
# shardstream that reads only version 1 refuses a version 2 index with a sentence instead of a traceback.
INDEX_VERSION = 2


@dataclass
class SliceRecord:
    """One rank's slice of one tensor; `split_dim` is None for a replicated tensor. `ranges`: the
    [start, stop) ranges along `split_dim` the slice concatenates (a tensor-parallel rank's share:
    heads and halves of fused projections, replicated KV heads); None in indexes written before them,
    whose slices are one equal block each. `quant`: the codes' quantization (as in the manifest), when
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
    """One expert's file: `file` is relative to its tier's root; `hint` is its tier's speed order."""

    tier: str
    group: int
    expert: int
    file: str
    hint: int
    tensors: dict[str, dict]   # name -> {dtype, shape, offset, length[, quant]}


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


def _read_plain(path: Path, view: memoryview, drop: bool) -> int:
    """Read the file into `view` in READ_CHUNK pieces, each one's pages dropped from the page cache when
    `drop`; returns the bytes read."""
    with open(path, "rb", buffering=0) as handle:
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:done + READ_CHUNK])
            if not got:
                break
            if drop:
                os.posix_fadvise(handle.fileno(), done, got, os.POSIX_FADV_DONTNEED)
            done += got
    return done


def _read_direct(path: Path, buffer, size: int) -> int | None:
    """Read the file's `size` bytes into `buffer` with O_DIRECT; None where that cannot be (no O_DIRECT
    on this system or filesystem, a buffer not page-aligned or too short for the page-rounded size)."""
    view = memoryview(buffer)[:aligned(size)]
    if not hasattr(os, "O_DIRECT") or len(view) < aligned(size):
        return None
    try:
        fd = open_file(path)
    except DirectUnsupported:
        return None
    try:
        return min(read_at(fd, path, view, 0), size)
    except DirectUnsupported:   # the buffer's address is not aligned, or the read was refused
        return None
    finally:
        os.close(fd)


def checked(data: bytes, record: FileRecord, where: str) -> bytes:
    """`data` if it matches its index record; a corrupt file is named and never used."""
    if len(data) != record.size or checksum_bytes(data) != record.xxh3_128:
        raise StoreCorrupt(
            f"{where} fails its checksum and is not used; rewrite a TP slice with `shardstream shard --tp`, "
            "restore an expert file from a backup (or rebuild: `shardstream convert`, then `shard --experts`)."
        )
    return data


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
    """One placed expert; its file is read and checksum-verified on first use of `tensors`."""

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
        """The expert's tensors from its file's bytes: views of them where stored plainly, else dequantized
        (or, not `dequantize`, their codes and scales viewing the bytes)."""
        return {n: decode_tensor(data, 0, TensorRecord(part="", file=self.record.file, **r), dequantize)
                for n, r in self.record.tensors.items()}

    def where(self) -> str:
        return str(PurePosixPath(self.index.tiers[self.record.tier]["root"]) / self.record.file)

    def contents(self, verify: bool) -> bytearray:
        """The file's bytes, checked against the index when `verify` (else only their length)."""
        data = self.raw()
        expected = self.index.files[self.record.file]
        if verify:
            checked(data, expected, self.where())
        elif len(data) != expected.size:
            raise StoreCorrupt(f"{self.where()} is {len(data)} bytes, not the {expected.size} its index says; "
                               "run `shardstream verify --parts experts`.")
        return data

    @property
    def path(self) -> Path | None:
        """The file on this machine (its tier's root may be outside the store); None in a remote store."""
        return None if self.store.remote else tier_root(self.store, self.index, self.record.tier) / self.record.file

    def read_into(self, buffer, drop: bool = False, dequantize: bool = True) -> dict[str, torch.Tensor | QuantizedTensor]:
        """The expert's tensors, viewing `buffer` (a writable buffer of at least the file's size: reused, it
        costs no page faults) where they are stored plainly, checksum-verified.

        `drop` (the experts outgrow memory, so every one is read again anyway, and under a cap that counts
        the page cache kept pages are reclaim to pay for): past the page cache, with O_DIRECT when `buffer`
        is page-aligned and of the file's page-rounded size (stream/direct.py's read buffers: huge pages,
        no copy on the CPU), else in READ_CHUNK pieces each dropped from the page cache once read."""
        expected = self.index.files[self.record.file]
        try:
            done = _read_direct(self.path, buffer, expected.size) if drop else None
            if done is None:
                done = _read_plain(self.path, memoryview(buffer)[:expected.size], drop)
        except FileNotFoundError:
            raise _missing(self.path) from None
        view = memoryview(buffer)[:expected.size]
        checked(view[:done], expected, self.where())
        return self._decode(view, dequantize)

    def raw(self) -> bytearray:
        """The file's bytes, unchecked."""
        record = self.record
        root = self.index.tiers[record.tier]["root"]
        if not Path(root).is_absolute():
            return self.store.read_raw(str(PurePosixPath(root) / record.file))
        if self.store.remote:
            raise InvalidOption(
                f"expert {record.group}:{record.expert} is on tier {record.tier!r} at {root}, outside the store; "
                "relocate it to a tier inside the store to serve it over HTTP."
            )
        return read_path(Path(root) / record.file)


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


def load_tp(store: StoreFiles, part: str, tp_rank: int, tp_size: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s slices of one part (written by `shardstream shard --tp`): reads that
    rank's file, checksum-verified, and nothing else of the part. MoE experts are not sliced."""
    if not 0 <= tp_rank < tp_size:
        raise InvalidOption(f"tp_rank must be in [0, tp_size), not {tp_rank} of {tp_size}.")
    index = load_index(store)
    records = [s for s in index.slices if s.part == part and s.rank == tp_rank and s.count == tp_size]
    if not records:
        raise StoreIncomplete(
            f"{store.root} has no rank {tp_rank} of {tp_size} slices for {part!r}; run "
            f"`shardstream shard {store.root} --tp {tp_size}` first."
        )
    name = records[0].file
    data = checked(store.read_raw(name), index.files[name], f"{store.root}/{name}")
    return {s.tensor: decode_tensor(data, 0, slice_tensor_record(s)).to(device) for s in records}


def slice_tensor_record(record: SliceRecord) -> TensorRecord:
    """The slice as a manifest tensor record (its part, file, bytes and quantization)."""
    return TensorRecord(part=record.part, file=record.file, dtype=record.dtype, shape=record.shape,
                        offset=record.offset, length=record.length, quant=record.quant)
