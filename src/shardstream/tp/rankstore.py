"""A rank's shares as a store of its own, so that the streaming engine opens it unchanged.

A rank reads its share of every block on every token when its shares do not fit its memory, so they
must lie in files of their own, in the layout a store has: one file per part, each tensor's record
giving the share's shape (quantized shares as codes, see reading.py). Two sources:

- the slices `shardstream shard STORE --tp N` exported (`exported_view`): a Store over the store's
  own `dense/...` rank files, whose manifest (in memory) lists this rank's slices (store/sharding.py's
  `rank_view`, which `Store.load(part, tp_rank=, tp_size=)` reads as well). Used where every share was
  exported as this rank's share (slices with `ranges`, or, in an older export, one equal block that is the share).
- otherwise the rank writes its shares once (`rank_folder`), reading only its bytes of the store's part
  files by offset: each part's file written to a temporary name, fsynced, read back against its
  checksum and renamed, the folder's manifest saved after every part, so a killed rank resumes where
  it stopped. The folder is `<store>/tp/rank_<r>_of_<n>` (or under `tp_cache`, by the store's fingerprint),
  one per rank: two ranks of one machine never write the same file. An MoE rank's folder holds its
  whole experts too (from the part files, fused expert tensors or the expert files placed on tiers), but
  where it reads them on demand (experts='on_demand'): then they stay in the store's expert files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..atomic import copy_file_atomic
from ..errors import InvalidOption, StoreIncomplete
from ..sizes import format_size
from ..store.manifest import MANIFEST_NAME, FileRecord, Manifest, PartRecord, TensorRecord, load_manifest
from ..store.partfile import EncodedPart, encode_stored
from ..store.reader import Store
from ..store.sharding import INDEX_NAME, SliceRecord, load_index, rank_view
from ..store.writer import part_file, write_encoded
from ..stream.weights import WeightMapper
from .experts import RankExperts
from .layout import Heads, Take, is_exported_block, rank_heads, take, tp_roles
from .reading import ShareReader, full_shape

log = logging.getLogger("shardstream.tp")
LAYOUT_VERSION = 1   # of a rank folder's files; a folder written by another layout is written again


@dataclass
class RankLayout:
    """What a rank holds: stored tensor name -> its share (a tensor that fills no parameter, such as an
    old rotary buffer, or another rank's expert, has none), the model's roles, the rank's heads and
    experts (experts.py)."""

    shares: dict[str, Take]
    roles: dict[str, str]
    heads: Heads
    experts: RankExperts


def rank_layout(store: Store, model: nn.Module, rank: int, size: int) -> RankLayout:
    """The rank's layout over `model` (the store's model on `meta`, full size): layout.py's shares of the
    dense tensors, whole experts of an MoE block (experts.py)."""
    roles = tp_roles(model)
    heads = rank_heads(model.config, rank, size)
    mapper = WeightMapper(model)
    experts = RankExperts(model, mapper, store, rank, size)
    shares = {}
    for key, record in store.manifest.tensors.items():
        if key in experts.stored:
            share = experts.take(key)
            if share is not None:
                shares[key] = share
            continue
        names = mapper.target_names([key])
        if len(names) != 1:
            continue
        module, _, kind = next(iter(names)).rpartition(".")
        shares[key] = take(module, roles.get(module), kind, full_shape(record), model.config, heads, rank, size)
    return RankLayout(shares, roles, heads, experts)


def encode_rank_part(store: Store, part: str, layout: RankLayout, reader: ShareReader,
                     experts: bool = True) -> EncodedPart:
    """The rank's shares of one part's tensors, and its experts of the block placed on tiers (their files
    read whole, checksum-verified, and counted in `reader`), laid out as a part file; `experts=False`:
    no MoE expert (an export, whose experts are placed, not sliced)."""
    shares = layout.shares
    stored = {key: reader.read(store.manifest.tensors[key], shares[key]) for key in store.manifest.parts[part].tensors
              if key in shares and (experts or key not in layout.experts.stored)}
    kind, _, block = part.partition("/")
    for expert in layout.experts.placed(int(block)) if kind == "mid" and experts else []:
        data = expert.contents(verify=True)
        reader.bytes_read += len(data)
        stored.update({name: (data, record) for name, record in expert.record.tensors.items()})
    return encode_stored(stored)


def rank_folder(store: Store, layout: RankLayout, rank: int, size: int, fingerprint: str,
                tp_cache: str | os.PathLike | None = None, experts: bool = True) -> tuple[Store, int]:
    """The rank's own store, written where missing (see the module docstring); and the bytes read from
    the store's part files to write it (0 when it was there). `experts=False`: without the MoE experts, which
    the rank reads on demand from the store's own expert files (a folder of its own, `..._experts_apart`)."""
    name = f"rank_{rank}_of_{size}" + ("" if experts else "_experts_apart")
    folder = (Path(tp_cache) / fingerprint[:16] if tp_cache else store.root / "tp") / name
    origin = {"store": fingerprint, "rank": rank, "size": size, "layout": LAYOUT_VERSION,
              **({} if experts else {"experts": "apart"})}
    manifest = _resumable(folder, origin)
    if manifest is not None and manifest.complete:
        return Store(folder, manifest), 0
    log.warning("rank %d of %d is writing its share of the store (about %s, once: later runs read it) to %s; "
                "pass --tp-cache DIR (tp_cache= in Python) to keep it elsewhere, and delete it to take the space back.",
                rank, size, format_size(sum(f.size for f in store.manifest.files.values()) // size), folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidOption(
            f"rank {rank} cannot write its shares to {folder} ({error.strerror}); pass a writable folder as "
            f"tp_cache (--tp-cache), or export the shares once with `shardstream shard {store.root} --tp {size}`."
        ) from None
    for name in sorted(os.listdir(store.root)):   # config, generation config and tokenizer files
        if name not in (MANIFEST_NAME, INDEX_NAME) and not name.startswith(".") and (store.root / name).is_file():
            copy_file_atomic(store.root / name, folder / name)
    source = store.manifest
    manifest = manifest or Manifest(source=str(store.root), config=source.config, family=source.family,
                                    compression=source.compression, expected_parts=list(source.expected_parts),
                                    aliases=dict(source.aliases), source_fingerprint=origin)
    reader = ShareReader(store)
    for part in store.parts:
        if part in manifest.parts:
            continue
        encoded = encode_rank_part(store, part, layout, reader, experts)
        name = part_file(part)
        digest = write_encoded(folder / name, encoded)
        manifest.files[name] = FileRecord(size=encoded.size, xxh3_128=digest)
        manifest.tensors.update({key: TensorRecord(part=part, file=name, **record) for key, record in encoded.records.items()})
        manifest.parts[part] = PartRecord(files=[name], tensors=sorted(encoded.records), nbytes=encoded.size)
        manifest.save(folder)
    manifest.complete = True
    manifest.save(folder)
    return Store(folder, manifest), reader.bytes_read


def rank_share(manifest: Manifest) -> tuple[int, int] | None:
    """(rank, ranks) when `manifest` is a rank folder's (its origin names them), else None."""
    origin = manifest.source_fingerprint or {}
    return (origin["rank"], origin["size"]) if {"store", "rank", "size"} <= origin.keys() else None


def _resumable(folder: Path, origin: dict) -> Manifest | None:
    """The folder's manifest when it was written for the same store, rank count and layout, keeping only
    the parts whose files are all there at their recorded size; else None (the folder is written anew)."""
    try:
        manifest = load_manifest(folder)
    except (OSError, StoreIncomplete, ValueError):   # none there, unreadable or damaged: written anew
        return None
    if manifest.source_fingerprint != origin:
        return None
    for part, record in list(manifest.parts.items()):
        if any(not (folder / f).is_file() or (folder / f).stat().st_size != manifest.files[f].size for f in record.files):
            del manifest.parts[part]
            manifest.complete = False
    return manifest


def exported_view(store: Store, layout: RankLayout, rank: int, size: int) -> Store | None:
    """The store's exported slices of `shardstream shard --tp size` for this rank (store/sharding.rank_view)
    when they hold exactly its shares, else None (always for an MoE model: exports do not hold a rank's experts)."""
    if layout.experts.modules:
        return None
    slices = {s.tensor: s for s in load_index(store).slices if s.rank == rank and s.count == size}
    tensors = store.manifest.tensors
    if not all(key in slices and _is_share(slices[key], share, full_shape(tensors[key]), rank, size)
               for key, share in layout.shares.items()):
        return None
    return rank_view(store, rank, size, layout.shares)


def _is_share(record: SliceRecord, share: Take, full: list[int], rank: int, size: int) -> bool:
    if share.zeros:
        return False   # exported whole: the rank would add a row-parallel bias a second time
    if record.ranges is None:   # an index written before ranges: one equal block along split_dim
        return is_exported_block(share, record.split_dim, full, rank, size)
    return record.split_dim == share.dim and [tuple(r) for r in record.ranges] == list(share.ranges)
