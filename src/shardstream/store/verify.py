"""Re-hash every file of a store against its manifest and its sharding index."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .checksum import checksum_bytes, checksum_file
from .manifest import FileRecord, load_manifest
from .reader import Store
from .sharding import Expert, ShardIndex, load_index, tier_root

MISMATCH = "checksum mismatch"


@dataclass(frozen=True)
class Problem:
    file: str     # relative to the store root when the file lives under it
    reason: str


def verify_store(root: Path, parts: list[str] | None = None) -> tuple[int, list[Problem]]:
    """Check sizes and checksums (the manifest's own checksum is checked on load).

    Returns the number of bytes hashed and the problems found; `parts` limits the check to files
    under those part paths (e.g. ["mid/3"]); PartNotFound for a name no file is under.
    """
    root = Path(root)
    manifest = load_manifest(root)
    store = Store(root, manifest)   # parts relocated to tiers are checked where they are
    for part in parts or []:   # a part not written yet is named by the store's incompleteness below
        if not any(_under(name, part) for name in [*manifest.files, *manifest.expected_parts]):
            raise store.no_part(part)
    hashed, problems = 0, []
    for name, record in sorted(manifest.files.items()):
        if parts and not any(_under(name, p) for p in parts):
            continue
        size, problem = _check(store.file_path(name), record, root)
        hashed, problems = hashed + size, problems + ([problem] if problem else [])
    if not manifest.complete:
        problems.append(Problem("manifest.json", "incomplete: conversion has not finished"))
    return hashed, problems


def _under(file: str, part: str) -> bool:
    """Whether the store file `file` belongs to part path `part` ("mid/3", or "mid" for all of them)."""
    return file == part or file.startswith(part.rstrip("/") + "/")


def verify_sharding(store: Store) -> tuple[int, list[Problem]]:
    """Like `verify_store`, for every TP slice and expert container the sharding index names; a container
    that fails its checksum is reported once for each expert in it whose own bytes fail theirs."""
    index = load_index(store)
    root = Path(store.root)
    locations = {name: root / name for name in {s.file for s in index.slices}}
    locations.update({r.file: tier_root(store, index, r.tier) / r.file for r in index.experts.values()})
    hashed, problems = 0, []
    for name, path in sorted(locations.items()):
        size, problem = _check(path, index.files[name], root)
        found = [problem] if problem else []
        if problem and problem.reason == MISMATCH:
            found = _damaged_experts(store, index, name, problem) or found
        hashed, problems = hashed + size, problems + found
    return hashed, problems


def _damaged_experts(store: Store, index: ShardIndex, file: str, problem: Problem) -> list[Problem]:
    """The experts of container `file` whose bytes fail their own checksums, one problem each."""
    bad = []
    for record in sorted(index.experts.values(), key=lambda r: (r.group, r.expert)):
        if record.file == file and checksum_bytes(Expert(store, index, record).raw()) != record.xxh3_128:
            bad.append(Problem(problem.file, f"{MISMATCH} in expert {record.key}"))
    return bad


def _check(path: Path, record: FileRecord, root: Path) -> tuple[int, Problem | None]:
    """(bytes hashed, the problem if any) for one file; the problem names it relative to `root`."""
    shown = os.path.relpath(path, root) if path.is_relative_to(root) else str(path)
    if not path.is_file():
        return 0, Problem(shown, "missing")
    size = path.stat().st_size
    if size != record.size:
        return 0, Problem(shown, f"{size} bytes, {record.size} expected")
    if checksum_file(path) != record.xxh3_128:
        return size, Problem(shown, MISMATCH)
    return size, None
