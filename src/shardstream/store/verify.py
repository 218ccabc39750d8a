"""Re-hash every file of a store against its manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checksum import checksum_file
from .manifest import load_manifest
from .reader import Store


@dataclass(frozen=True)
class Problem:
    file: str
    reason: str


def verify_store(root: Path, parts: list[str] | None = None) -> tuple[int, list[Problem]]:
    """Check sizes and checksums (the manifest's own checksum is checked on load).

    Returns the number of bytes hashed and the problems found; `parts` limits the check to files
    under those part paths (e.g. ["mid/3"]).
    """
    root = Path(root)
    manifest = load_manifest(root)
    store = Store(root, manifest)   # parts relocated to tiers are checked where they are
    problems: list[Problem] = []
    hashed = 0
    for name, record in sorted(manifest.files.items()):
        if parts and not any(name == p or name.startswith(p.rstrip("/") + "/") for p in parts):
            continue
        path = store.file_path(name)
        if not path.is_file():
            problems.append(Problem(name, "missing"))
            continue
        size = path.stat().st_size
        if size != record.size:
            problems.append(Problem(name, f"{size} bytes, manifest says {record.size}"))
            continue
        hashed += size
        if checksum_file(path) != record.xxh3_128:
            problems.append(Problem(name, "checksum mismatch"))
    if not manifest.complete:
        problems.append(Problem("manifest.json", "incomplete: conversion has not finished"))
    return hashed, problems
