"""Storage tiers: defining them, and the copy-and-verify half of moving whole parts between them.

Experts (`experts.relocate`) and whole parts (`parts.relocate_part`) move in the same
RELOCATION_STEPS: copy (the source checked against its record; an expert's block gets new
containers) -> verify (re-hash what was written) -> index (switch `sharding.json` atomically) ->
remove (the old copies). A part's first two live here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ..atomic import write_bytes_atomic
from ..errors import InvalidOption
from ..store.checksum import checksum_file
from ..store.manifest import FileRecord, check_relative
from ..store.reader import Store
from ..store.sharding import INDEX_NAME, ShardIndex, checked, read_path

RELOCATION_STEPS = ("copy", "verify", "index", "remove")


def parse_tiers(spec: str) -> dict[str, str]:
    """`hot=/nvme,warm=/ssd` -> {"hot": "/nvme", "warm": "/ssd"}, order kept (fastest first)."""
    tiers = {}
    for item in spec.split(","):
        name, sep, root = item.partition("=")
        if name in tiers:
            raise InvalidOption(f"--tiers names tier {name!r} twice; give each tier one folder.")
        if not sep or not re.fullmatch(r"[a-z0-9_]+", name) or not root:
            raise InvalidOption(f"--tiers entry {item!r} is not valid; write name=folder pairs like hot=/nvme,cold=/hdd.")
        tiers[name] = root
    return tiers


def define_tiers(store: Store, index: ShardIndex, tiers: dict[str, str]) -> None:
    """Add `tiers` (name -> root, fastest first) to `index`; a known tier must keep its root. A listing of
    every known tier orders them all; one that leaves some out puts its new tiers after them."""
    for name, root in tiers.items():
        if not Path(root).is_absolute() and (root.startswith("~") or ".." in Path(root).parts):
            raise InvalidOption(f"--tiers folder {root!r} of tier {name!r} is outside the store: a relative folder is "
                                "inside it; give a folder outside as an absolute path.")
        if not Path(root).is_absolute():
            check_relative(root, "--tiers")
        if index.tiers.get(name, {"root": root})["root"] != root:
            raise InvalidOption(
                f"tier {name!r} already has root {index.tiers[name]['root']} in {store.root}/{INDEX_NAME}; "
                "keep that root or relocate its experts and parts first."
            )
    if set(index.tiers) <= set(tiers):   # every tier listed: the listing's order is theirs
        index.tiers.update({name: {"root": root, "hint": i} for i, (name, root) in enumerate(tiers.items())})
        return
    for name, root in tiers.items():   # a tier added later is slower than those it joins
        index.tiers.setdefault(name, {"root": root, "hint": 1 + max(tier["hint"] for tier in index.tiers.values())})


def check_tier(store: Store, index: ShardIndex, tier: str) -> None:
    """Refuse a relocation target the index does not define."""
    if tier not in index.tiers:
        known = ", ".join(index.tiers) or "none yet"
        raise InvalidOption(f"{store.root}/{INDEX_NAME} has no tier {tier!r} (it has {known}); define tiers with "
                            "`shardstream shard STORE --tiers name=folder,...` first.")


def copy_verified(moves: list[tuple[Path, Path, FileRecord]], on_step: Callable[[str], None]) -> None:
    """Steps "copy" and "verify" for (source, destination, record) files: each source is checked
    before it is copied (atomically), each copy re-hashed after. A file already in place is kept."""
    for source, dest, record in moves:
        if source != dest:
            write_bytes_atomic(dest, checked(read_path(source), record, str(source)))
    on_step("copy")
    for _, dest, record in moves:
        if checksum_file(dest) != record.xxh3_128:
            raise OSError(f"{dest} reads back different from what was written; check that disk and re-run.")
    on_step("verify")
