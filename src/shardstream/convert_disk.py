"""Disk-space checks: abort before writing what cannot fit, warn when little would stay free.

The check counts everything still to be written (the output of every shard not yet converted, the
downloads a remote source stages, the manifest), not just the next shard: a store that cannot be
finished is refused before it takes the disk. A sequential run from a local folder on the same
disk is the exception: each shard it deletes frees more than it turns into, so only the next
shard's output must fit (once the shards converted before it are deleted: convert.py waits for that
where the room is not there yet).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from . import quant
from .errors import DiskSpaceError
from .sizes import format_size
from .sources import CheckpointSource, LocalSource
from .sources.remote import RemoteSource
from .store import MANIFEST_NAME

if TYPE_CHECKING:
    from .options import ConversionOptions

SLACK = 65536   # folders and the temp file beside each rename


def check_disk(src: CheckpointSource, root: Path, conversion: ConversionOptions, todo: list[str],
               min_free_space: int | None = None) -> None:
    """Raise DiskSpaceError unless the shards in `todo` (in order) can still be converted into `root` with
    `conversion`'s compression and mode; warn when that would leave less than `min_free_space` (checked once,
    before the first shard)."""
    if not todo:
        return
    free, needed = disk_room(src, root, conversion, todo)
    if free < needed:
        raise DiskSpaceError(
            f"{root} has {format_size(free)} free but converting the {len(todo)} shard{'s' if len(todo) > 1 else ''} "
            f"left needs about {format_size(needed)}; free some space (or give an output folder on a bigger disk) "
            "and re-run, nothing was written that does not fit."
        )
    if min_free_space is not None and free - needed < min_free_space:
        warnings.warn(
            f"low disk space in {root}: {format_size(free)} free, about {format_size(needed)} still to write, "
            f"which leaves less than --min-free-space ({format_size(min_free_space)}).",
            stacklevel=2,
        )


def disk_room(src: CheckpointSource, root: Path, conversion: ConversionOptions, todo: list[str]) -> tuple[int, int]:
    """(bytes free on the disk of `root`, bytes converting the shards in `todo` with `conversion` still
    needs there)."""
    free = shutil.disk_usage(root).free
    sizes = [src.shard_size(s) or 0 for s in todo]
    ratio = compression_ratio(conversion.compression)
    manifest = root / MANIFEST_NAME
    overhead = 2 * (manifest.stat().st_size if manifest.exists() else 0) + SLACK   # manifest rewritten beside itself
    output = int(sum(sizes) * ratio)
    downloads = 0
    if isinstance(src, RemoteSource):
        downloads = max(sizes) if conversion.sequential else sum(sizes)   # one staged shard at a time, or all first
    elif conversion.sequential and isinstance(src, LocalSource) and _same_disk(src.root, root):
        output = int(sizes[0] * ratio)   # the shards deleted on the way free the room for the rest
    return free, output + downloads + overhead


def _same_disk(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def compression_ratio(compression: str | None) -> float:
    """Output bytes per input byte, assuming 16-bit weights (a safe upper estimate for fp32)."""
    if compression is None:
        return 1.0
    scale_bytes = quant.SCALE_DTYPES[compression].itemsize
    return quant.CODE_BITS[compression] / 16 + scale_bytes / (quant.DEFAULT_BLOCKSIZE[compression] * 2)
