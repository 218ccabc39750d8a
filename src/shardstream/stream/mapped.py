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
from collections.abc import Iterable

import numpy as np
import torch

from ..quant import QuantizedTensor, held_by
from ..store import Store, problems
from ..store.checksum import checksum_bytes, checksum_file
from ..store.manifest import TensorRecord

PAGE = mmap.PAGESIZE


def map_part(store: Store, part: str, verify: bool = False, mappings: list[mmap.mmap] | None = None,
             experts: bool = True, keep_quantized: frozenset[str] = frozenset(), tied: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of one part viewing private mappings of its files, checksummed when `verify`.

    Verifying hashes the mapping itself: the bytes stay page-cache pages the kernel may reclaim,
    not a second (anonymous) copy that counts against a memory cap until the block is dropped.
    The mappings are appended to `mappings` when given (see `cool`). Experts stored apart are read
    from their tiers (checked when `verify`) unless `experts=False`; `keep_quantized`, `tied` as in `Store.load`.
    """

    def read(file_name: str) -> mmap.mmap:
        mapping = _map_file(store, file_name, verify)
        if mappings is not None:
            mappings.append(mapping)
        return mapping

    return store.load(part, read=read, verify=verify, experts=experts, keep_quantized=keep_quantized, tied=tied)


def map_ranges(store: Store, names: list[str], mappings: list[mmap.mmap]) -> dict[str, mmap.mmap]:
    """{file: private mapping} for these stored tensors' files (all local part files, none an alias),
    appended to `mappings` too; only the tensors' own pages (and a quantized tensor's scales) are read in."""
    records = [store.manifest.tensors[name] for name in names]
    mapped = {}
    for file_name in sorted({r.file for r in records}):
        mapped[file_name] = _map_file(store, file_name, ranges=[s for r in records if r.file == file_name for s in spans(r)])
        mappings.append(mapped[file_name])
    return mapped


def spans(record: TensorRecord) -> list[tuple[int, int]]:
    """The (begin, end) file byte ranges a stored tensor is decoded from: its data, and its scales when quantized."""
    found = [(record.offset, record.offset + record.length)]
    if record.quant:
        scales = record.quant["absmax"]
        found.append((scales["offset"], scales["offset"] + scales["length"]))
    return found


def _map_file(store: Store, file_name: str, verify: bool = False,
              ranges: list[tuple[int, int]] | None = None) -> mmap.mmap:
    """A private mapping of the file, its pages read in now (only those of `ranges` when given)."""
    path = store.file_path(file_name)
    expected = store.manifest.files[file_name].size
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise problems.missing(path) from None
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise problems.wrong_size(path, size, expected)
        pages = [(b // PAGE * PAGE, e) for b, e in ranges or [(0, size)] if e > b]
        for begin, end in pages:
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)  # start reading now
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private and writable: torch.frombuffer wants that
    finally:
        os.close(fd)
    for begin, end in pages:
        mapping.madvise(mmap.MADV_WILLNEED, begin, end - begin)
    if verify:  # hashing reads every page, on this thread
        if checksum_bytes(mapping) != store.manifest.files[file_name].xxh3_128:
            raise problems.fails_checksum(path)
    else:
        for begin, end in pages:  # fault the pages in now, on this thread
            np.frombuffer(mapping, dtype=np.uint8, count=end - begin, offset=begin)[::PAGE].max()
    return mapping


def release_unviewed(mappings: list[mmap.mmap], tensors: Iterable[torch.Tensor | QuantizedTensor]) -> int:
    """Unmap from this process the pages of these mappings that none of `tensors` views: what conversion
    copied (a Mixtral block's experts stacked into one tensor, weights cast to another compute dtype), so that
    a resident part is not in memory twice, once as the file's pages and once converted (docs/BENCHMARKS.md,
    section "Real shapes", the Mixtral-8x7B shape). The pages stay in the page cache, where
    the kernel may reclaim them; a page touched again is read back. Returns the bytes released."""
    views = []
    for tensor in tensors:
        for part in held_by(tensor):
            if part.device.type == "cpu" and part.numel():
                storage = part.untyped_storage()
                views.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    views.sort()
    released = 0
    for mapping in mappings:
        try:
            base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        except (ValueError, TypeError):   # closed
            continue
        at = base
        for begin, end in [*((b, e) for b, e in views if e > base and b < base + len(mapping)), (base + len(mapping), 0)]:
            first, last = -(-(at - base) // PAGE) * PAGE, (begin - base) // PAGE * PAGE   # whole pages of the gap
            if last > first:
                mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
                released += last - first
            at = max(at, end)
    return released


MADV_COLD = getattr(mmap, "MADV_COLD", 20)  # Linux 5.4+; Python's mmap module may not name it


def cool(mappings: list[mmap.mmap]) -> None:
    """Tell the kernel these pages are the first to reclaim (they are needed again only next token).

    Under memory pressure (a model larger than memory), reading the next block must evict
    something: without the hint the kernel may pick the pages the running block still needs, or
    the head's. With no pressure nothing is evicted, so a warm page cache stays warm. Then drop
    the references, so the mappings go with the last tensor viewing them.
    """
    for mapping in mappings:
        try:
            mapping.madvise(MADV_COLD)
        except (OSError, ValueError):  # older kernel, or already closed
            pass
    mappings.clear()


def verify_mapped(store: Store, file_name: str) -> None:
    """Hash the whole file through a small buffer (a mapping hashed whole would count all its pages
    at once against a memory cap); StoreCorrupt if it differs."""
    path = store.file_path(file_name)
    if not path.is_file():
        raise problems.missing(path)
    record = store.manifest.files[file_name]
    if path.stat().st_size != record.size:
        raise problems.wrong_size(path, path.stat().st_size, record.size)
    if checksum_file(path) != record.xxh3_128:
        raise problems.fails_checksum(path)
