"""Whole parts (`start`, `mid/<l>`, `end`) moved between storage tiers, crash-safely.

A relocated part keeps its file names; its files sit under the tier's root instead of the store
root (`<tier root>/mid/3/weights.safetensors`), and `sharding.json`'s `parts` says which tier.
`Store.file_path` resolves every read through it, so loading, streaming, verifying and packaging
pipeline stages work unchanged. Same steps as an expert's relocation: copy -> verify -> index ->
remove; a kill at any point leaves the index naming a complete, verified copy, and re-running the
same `relocate` finishes the move.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..atomic import discard_temp_files, write_bytes_atomic
from ..errors import InvalidOption
from ..store.checksum import checksum_file
from ..store.reader import Store
from ..store.sharding import INDEX_NAME, checked, load_index, read_path, tier_root


def relocate_part(store: Store, part: str, tier: str, on_step: Callable[[str], None] = lambda step: None) -> str:
    """Move every file of `part` to `tier` (see module doc); returns the tier it is on."""
    files = store.part_files(part)
    index = load_index(store, for_update=True)
    if tier not in index.tiers:
        known = ", ".join(index.tiers) or "none yet"
        raise InvalidOption(f"{store.root}/{INDEX_NAME} has no tier {tier!r} (it has {known}); define tiers with "
                            "`shardstream shard STORE --tiers name=folder,...` first.")
    target = {name: tier_root(store, index, tier) / name for name in files}
    if index.parts.get(part) != tier:
        for name in files:
            source = store.file_path(name)
            if source != target[name]:
                write_bytes_atomic(target[name], checked(read_path(source), store.manifest.files[name], str(source)))
        on_step("copy")
        for name in files:
            if checksum_file(target[name]) != store.manifest.files[name].xxh3_128:
                raise OSError(f"{target[name]} reads back different from what was written; check that disk and re-run.")
        on_step("verify")
        index.parts[part] = tier
        index.save(store)
        on_step("index")
    stale = [store.root / name for name in files] + [tier_root(store, index, other) / name
                                                     for other in index.tiers for name in files]
    for path in stale:
        if path not in target.values() and path.exists():
            path.unlink()
    for folder in {path.parent for path in [*stale, *target.values()]}:
        if folder.is_dir():
            discard_temp_files(folder)
    on_step("remove")
    return tier
