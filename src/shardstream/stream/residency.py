"""Which blocks stay in memory between tokens.

Blocks are used in a fixed cycle, 0..n-1 then 0 again. For a cyclic scan, least-recently-used
eviction is the worst policy: the block it evicts is always the one needed soonest, so a budget of
k < n blocks would give no hits at all. Keeping a fixed set (the first k blocks that fit) gives
exactly k hits per token, which is the best any policy can do for this pattern.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from ..errors import InvalidOption

AUTO_SHARE = 0.5  # of the memory available at load time; leaves room for the page cache, KV cache and activations


def available_memory() -> int:
    """RAM this process may still use: psutil's figure, or less when a cgroup (container) caps memory."""
    available = psutil.virtual_memory().available
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return available
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "memory":  # cgroup v1
            folder, limit_file, usage_file = Path("/sys/fs/cgroup/memory" + path), "memory.limit_in_bytes", "memory.usage_in_bytes"
        elif controllers == "":  # cgroup v2
            folder, limit_file, usage_file = Path("/sys/fs/cgroup" + path), "memory.max", "memory.current"
        else:
            continue
        try:
            limit, usage = (folder / limit_file).read_text().strip(), int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            available = min(available, max(0, int(limit) - usage))
    return available


def resolve_budget(max_resident_memory: int | str | None, fixed_bytes: int) -> int:
    """Bytes of blocks to keep resident; 'auto' = half the available RAM minus what is resident anyway."""
    if max_resident_memory == "auto":
        return max(0, int(available_memory() * AUTO_SHARE) - fixed_bytes)
    if max_resident_memory is None:
        return 0
    if isinstance(max_resident_memory, bool) or not isinstance(max_resident_memory, int) or max_resident_memory < 0:
        raise InvalidOption(
            f"max_resident_memory must be 'auto' or a number of bytes >= 0, not {max_resident_memory!r}."
        )
    return max_resident_memory


def choose_resident(block_bytes: list[int], budget: int, streaming_bytes: int = 0) -> list[int]:
    """The first blocks, in order, that fit in `budget` together.

    When not all fit, the blocks still streamed need `streaming_bytes` (the prefetch working set)
    out of the same budget.
    """
    if sum(block_bytes) <= budget:
        return list(range(len(block_bytes)))
    chosen, used = [], streaming_bytes
    for index, size in enumerate(block_bytes):
        if used + size > budget:
            break
        chosen.append(index)
        used += size
    return chosen
