"""`open_store`: a store folder or an http(s):// store URL, whichever the user named.

Apart from reader.py so that the local reader and the remote one (which builds on it) do not
import each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import StoreIncomplete
from .manifest import load_manifest
from .reader import Store
from .remote import open_remote_store


def open_store(path: str | os.PathLike, *, allow_incomplete: bool = False) -> Store:
    """Open a store folder or an http(s):// store URL; an unfinished one is refused unless `allow_incomplete`."""
    if str(path).startswith(("http://", "https://")):
        return open_remote_store(str(path), allow_incomplete=allow_incomplete)
    root = Path(path)
    if not root.exists():
        raise StoreIncomplete(f"{root} does not exist; give the output folder of `shardstream convert`.")
    if not root.is_dir():
        raise StoreIncomplete(f"{root} is not a folder; give the output folder of `shardstream convert`.")
    manifest = load_manifest(root)
    if not manifest.complete and not allow_incomplete:
        raise StoreIncomplete(
            f"the store at {root} is incomplete (conversion was interrupted); re-run the same "
            "`shardstream convert` command to finish it."
        )
    return Store(root, manifest)
