"""Loading a part by mapping its files instead of copying them.

`Store.load` reads a file into a fresh buffer: one full memory copy (and page faults on the new
buffer) per block per token, CPU time that competes with the compute it should hide behind. A
private mapping shares the page cache's pages instead; touching every page on the reader thread
makes the kernel read them from disk there, not later inside the forward pass. The mapping is
dropped when the last tensor viewing it is released. (Candidate for `Store.load(..., mmap=True)`.)
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from ..errors import StoreCorrupt, StoreIncomplete
from ..store import Store
from ..store.checksum import checksum_bytes
from ..store.partfile import decode_tensor

PAGE = mmap.PAGESIZE


def map_part(store: Store, part: str, verify: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of one part viewing private mappings of its files, checksummed when `verify`.

    Verifying hashes the mapping itself: the bytes stay page-cache pages the kernel may reclaim,
    not a second (anonymous) copy that counts against a memory cap until the block is dropped.
    """
    record = store.manifest.parts[part]
    tensors: dict[str, torch.Tensor] = {}
    for file_name in record.files:
        mapping = _map_file(store, file_name, verify)
        for name in record.tensors:
            meta = store.manifest.tensors[name]
            if meta.file == file_name:
                tensors[name] = decode_tensor(mapping, 0, meta)
    for alias, info in store.manifest.aliases.items():
        if info["part"] == part:
            tensors[alias] = store.load_tensor(info["target"])
    return tensors


def _map_file(store: Store, file_name: str, verify: bool = False) -> mmap.mmap:
    path = store.root / file_name
    expected = store.manifest.files[file_name].size
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreIncomplete(f"{path} is missing; re-run `shardstream convert` to repair the store.") from None
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise StoreCorrupt(
                f"{path} is {size} bytes but the manifest says {expected}; re-run `shardstream convert` to repair the store."
            )
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)  # start reading the whole file now
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private and writable: torch.frombuffer wants that
    finally:
        os.close(fd)
    mapping.madvise(mmap.MADV_WILLNEED)
    if verify:  # hashing reads every page, on this thread
        if checksum_bytes(mapping) != store.manifest.files[file_name].xxh3_128:
            raise StoreCorrupt(f"{path} fails its checksum; re-run `shardstream convert` to repair the store.")
    elif size:
        np.frombuffer(mapping, dtype=np.uint8)[::PAGE].max()  # fault every page in now, on this thread
    return mapping
