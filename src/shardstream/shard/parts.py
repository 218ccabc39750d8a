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

from ..atomic import discard_temp_files
from ..store.lock import editing
from ..store.reader import Store
from ..store.sharding import load_index, tier_root
from .tiers import check_tier, copy_verified


@editing
def relocate_part(store: Store, part: str, tier: str, on_step: Callable[[str], None] = lambda step: None) -> str:
    """Move every file of `part` to `tier` (see module doc); returns the tier it is on."""
    files = store.part_files(part)
    index = load_index(store, for_update=True)
    check_tier(store, index, tier)
    target = {name: tier_root(store, index, tier) / name for name in files}
    if index.parts.get(part) != tier:
        copy_verified([(store.file_path(name), target[name], store.manifest.files[name]) for name in files], on_step)
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
