"""Disk-space checks before each shard: abort before the disk fills, warn when it runs low."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from .errors import DiskSpaceError
from .sources import CheckpointSource
from .sources.remote import RemoteSource
from .store import MANIFEST_NAME


def check_disk(src: CheckpointSource, root: Path, compression: str | None, shard: str, index: int,
               min_free_space: int) -> None:
    """Raise when the next shard cannot fit; warn when what remains would leave less than the threshold."""
    free = shutil.disk_usage(root).free
    shard_bytes = src.shard_size(shard) or 0
    remote = isinstance(src, RemoteSource)
    ratio = compression_ratio(compression)
    manifest = root / MANIFEST_NAME
    manifest_bytes = manifest.stat().st_size if manifest.exists() else 0
    # the shard (when downloaded), what it turns into, and the manifest rewritten beside itself
    next_step = (shard_bytes if remote else 0) + int(shard_bytes * ratio) + 2 * manifest_bytes + 65536
    remaining = sum(src.shard_size(s) or 0 for s in src.shard_names()[index:])
    if free < next_step:
        raise DiskSpaceError(
            f"only {free / 1e9:.2f} GB free in {root} but the next shard {shard} "
            f"needs about {next_step / 1e9:.2f} GB; free some space and re-run (finished parts are kept)."
        )
    if free - int(remaining * ratio) < min_free_space:
        warnings.warn(
            f"low disk space in {root}: {free / 1e9:.2f} GB free, about "
            f"{remaining * ratio / 1e9:.2f} GB still to write (threshold "
            f"{min_free_space / 1e9:.2f} GB).",
            stacklevel=2,
        )


def compression_ratio(compression: str | None) -> float:
    """Output bytes per input byte, assuming 16-bit weights (a safe upper estimate for fp32)."""
    if compression is None:
        return 1.0
    bits, blocksize = {"4bit": (4, 64), "8bit": (8, 256)}[compression]
    return bits / 16 + 4 / (blocksize * 2)
