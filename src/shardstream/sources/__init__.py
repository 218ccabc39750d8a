"""Where checkpoints come from: a local folder, an HTTP(S) base URL or a Hub id.

`open_source` picks the kind from the spec; every kind hands out one shard at a time (`fetch`,
then `release`), so a converter never needs more disk than one shard plus its output.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardstream.errors import SourceNotFound
from shardstream.sources.base import CheckpointSource
from shardstream.sources.http import HttpSource
from shardstream.sources.local import LocalSource

__all__ = ["CheckpointSource", "HttpSource", "LocalSource", "open_source"]

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def open_source(
    spec: str | os.PathLike,
    staging_dir: Path,
    *,
    token: str | None = None,
    revision: str | None = None,
    progress: bool = True,
) -> CheckpointSource:
    """An existing path is a folder; http(s):// a URL; `hf://org/name` or a bare `org/name` the Hub."""
    text = os.fspath(spec)
    if text.startswith(("http://", "https://")):
        return HttpSource(text, staging_dir, token=token, progress=progress)
    path = Path(text).expanduser()
    if not text.startswith("hf://") and path.exists():
        return LocalSource(path)
    repo_id = text.removeprefix("hf://")
    if HUB_ID.fullmatch(repo_id):  # never ./x, /x or ~/x: those are paths that do not exist
        from shardstream.sources.hub import HubSource  # imports huggingface_hub only when needed

        return HubSource(repo_id, staging_dir, token=token, revision=revision, progress=progress)
    raise SourceNotFound(
        f"{text} does not exist; give a checkpoint folder, an http(s):// URL or a Hub id like org/name."
    )
