"""Which blocks stay in memory between tokens.

Blocks are used in a fixed cycle, 0..n-1 then 0 again. For a cyclic scan, least-recently-used
eviction is the worst policy: the block it evicts is always the one needed soonest, so a budget of
k < n blocks would give no hits at all. Keeping a fixed set (the first k blocks that fit) gives
exactly k hits per token, which is the best any policy can do for this pattern.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ..errors import InvalidOption
from ..memory import available_memory, gpu_free_bytes

if TYPE_CHECKING:
    import torch

BATCH_RESIDENT_SHARE = 0.25  # of `auto`'s resident-block budget when batching; the rest is left to the batch
HOST_SHARE = 0.5  # of the RAM available, page-locked by a GPU model's host tier: the kernel can neither swap nor reclaim it
AUTO_SHARE = 0.75  # of the memory available once the fixed parts are loaded; the rest is slack for the page cache, KV cache and activations


def auto_budget(fixed_bytes: int, device: torch.device | str | None = None) -> int:
    """The bytes of blocks 'auto' keeps resident on `device`: AUTO_SHARE of the memory available after the
    fixed parts (embeddings, head) were loaded: on a GPU, the GPU's free memory (which counts those parts
    already); on the CPU, RAM, divided among the processes that share it (`machine_processes`). A cgroup's
    usage already counts those parts' pages; the system-wide figure counts them as reclaimable page cache,
    so there they are subtracted. Blocks kept resident are reads saved on every pass (docs/BENCHMARKS.md,
    "Stream" compares it with pure streaming).
    """
    if str(device).startswith("cuda"):
        return int(gpu_free_bytes(device) * AUTO_SHARE)
    available, capped = available_memory()
    return max(0, int(available * AUTO_SHARE) // machine_processes() - (0 if capped else fixed_bytes))


def machine_processes() -> int:
    """The processes whose models share this machine's RAM: the ranks torchrun started on it
    (LOCAL_WORLD_SIZE, tensor parallelism), else this one; each takes an equal share of `auto`."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def bytes_option(name: str, value: int | str | None) -> int:
    """A memory option given as bytes >= 0, or None: no limit."""
    if value is None:
        return sys.maxsize
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidOption(f"{name} must be 'auto', None (no limit) or a number of bytes >= 0, not {value!r}.")
    return value


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


def batch_auto_budget(device: torch.device | str) -> int:
    """`auto` for a batch (serve, offline) keeps blocks resident out of BATCH_RESIDENT_SHARE of what it
    would alone: a resident block saves one block read per pass, while the same bytes of KV cache let
    more requests share every pass, and a full batch is bound by compute, not reads (docs/BENCHMARKS.md,
    "Many tokens per weight read", has the shares tried)."""
    return int(auto_budget(0, device) * BATCH_RESIDENT_SHARE)
