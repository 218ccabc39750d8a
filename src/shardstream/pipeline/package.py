"""A stage as a folder of plain files: the store's files for its parts, its config, the store
manifest, and `stage.json`, the stage manifest that lists every file with size and checksum.

A stage of a model whose experts were placed on tiers (`place_experts`) also gets its blocks'
expert containers (whole: a container holds one block's experts on one tier), wherever their tier
is, and its own `sharding.json` naming just those, every tier rooted inside the stage folder: the
agent reads experts from there, each checksum-verified on use.

The stage id is the checksum of `stage.json`, so an agent that already holds a stage with that id
(from an earlier plan epoch) need not download it again. Files are hard links into the store where
the file system allows, else streamed copies: packaging never holds more than a copy buffer.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_bytes_atomic
from ..store.sharding import INDEX_NAME, ShardIndex, load_index, tier_root
from ..store import MANIFEST_NAME, Store
from ..store.checksum import checksum_bytes, checksum_file
from .planner import Plan

STAGE_MANIFEST = "stage.json"
META_FILES = (MANIFEST_NAME, "config.json", "generation_config.json")


@dataclass(frozen=True)
class StagePackage:
    """One packaged stage: blocks [first, last) in `folder`, known to agents by `stage_id`."""

    first: int
    last: int
    folder: Path
    stage_id: str


def stage_manifest(store: Store, first: int, last: int) -> bytes:
    """The canonical `stage.json`: weight files (with the files that tied tensors point into), the
    blocks' placed experts with their index, and meta files."""
    return _stage_files(store, first, last)[0]


def _stage_files(store: Store, first: int, last: int) -> tuple[bytes, dict[str, Path | bytes]]:
    """`stage.json`, and where each of its files comes from: a path, or bytes made for the stage."""
    manifest = store.manifest
    files, sources = {}, {}
    for part in store.parts_of(range(first, last)):
        for name in store.read_files(part):
            record = manifest.files[name]
            files[name], sources[name] = {"size": record.size, "xxh3_128": record.xxh3_128}, store.file_path(name)
    index = load_index(store)
    experts = {key: r for key, r in index.experts.items() if first <= r.group < last}
    if experts:
        for record in experts.values():   # one entry per container, however many experts it holds
            files[record.file] = {"size": index.files[record.file].size, "xxh3_128": index.files[record.file].xxh3_128}
            sources[record.file] = tier_root(store, index, record.tier) / record.file
        sources[INDEX_NAME] = ShardIndex(
            tiers={name: {**tier, "root": "."} for name, tier in index.tiers.items()}, experts=experts,
            files={r.file: index.files[r.file] for r in experts.values()}).to_bytes()
        files[INDEX_NAME] = {"size": len(sources[INDEX_NAME]), "xxh3_128": checksum_bytes(sources[INDEX_NAME])}
    for name in META_FILES:
        path = store.root / name
        if path.is_file():
            files[name], sources[name] = {"size": path.stat().st_size, "xxh3_128": checksum_file(path)}, path
    body = {"format": 1, "first": first, "last": last, "num_layers": store.num_layers, "files": files}
    return json.dumps(body, sort_keys=True, indent=1).encode(), sources


def package_stage(store: Store, first: int, last: int, root: Path) -> StagePackage:
    """Write (or reuse) the stage's folder under `root`, named by its stage id."""
    body, sources = _stage_files(store, first, last)
    stage_id = checksum_bytes(body)
    folder = Path(root) / stage_id
    if not (folder / STAGE_MANIFEST).is_file():
        for name, source in sources.items():
            if isinstance(source, bytes):
                write_bytes_atomic(folder / name, source)
            else:
                _link_or_copy(source, folder / name)
        write_bytes_atomic(folder / STAGE_MANIFEST, body)
    return StagePackage(first, last, folder, stage_id)


def package_plan(store: Store, plan: Plan, root: Path) -> list[StagePackage]:
    return [package_stage(store, s.first_layer, s.last_layer_exclusive, root) for s in plan.stages]


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)
