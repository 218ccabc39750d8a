"""From what the user names (Hub id, URL, checkpoint folder or store) to an open, complete store."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..convert import convert
from ..errors import StoreIncomplete
from ..store import MANIFEST_NAME, Store, load_manifest, open_store

CACHE_ENV = "SHARDSTREAM_CACHE"


def default_store_path(source: str) -> Path:
    """~/.cache/shardstream/<slug> (or $SHARDSTREAM_CACHE/<slug>)."""
    base = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "shardstream")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", str(source).rstrip("/")).strip("-.") or "model"
    return base / slug


def ensure_store(source: str | os.PathLike, store_path: str | os.PathLike | None, **convert_options) -> Store:
    """Open the store, converting `source` into it first when it is missing or unfinished.

    `source` may itself be a store folder; an unfinished one is finished from the source its
    manifest records.
    """
    source = str(source)
    if store_path is None and (Path(source) / MANIFEST_NAME).is_file():
        store_path = source
        manifest_source = load_manifest(Path(source)).source
        source = manifest_source or source
    path = Path(store_path) if store_path is not None else default_store_path(source)
    try:
        return open_store(path)
    except StoreIncomplete:
        if Path(source).resolve() == path.resolve():
            raise
    convert(source, path, **convert_options)
    return open_store(path)
