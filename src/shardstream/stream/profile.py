"""Per-block timings of streaming: how long reads took, how long compute waited, how long it ran."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class BlockTimes:
    passes: int = 0
    read: float = 0.0
    wait: float = 0.0
    compute: float = 0.0


class Profile:
    """Accumulates timings; `hidden_share` is the part of read time that overlapped compute."""

    def __init__(self) -> None:
        self.blocks: dict[int, BlockTimes] = defaultdict(BlockTimes)

    def record(self, index: int, read: float, wait: float, compute: float) -> None:
        times = self.blocks[index]
        times.passes += 1
        times.read += read
        times.wait += wait
        times.compute += compute

    def reset(self) -> None:
        self.blocks.clear()

    @property
    def total(self) -> BlockTimes:
        total = BlockTimes()
        for times in self.blocks.values():
            total.passes += times.passes
            total.read += times.read
            total.wait += times.wait
            total.compute += times.compute
        return total

    @property
    def hidden_share(self) -> float:
        """1 - wait/read: 1.0 when every read finished before its block was needed."""
        total = self.total
        return 1.0 - min(total.wait, total.read) / total.read if total.read else 1.0

    def table(self, resident: list[int], blocks: int) -> str:
        """The streamed blocks' timings; `resident` (of `blocks`) are never read, so they have none."""
        kept = f"{len(resident)} of {blocks} blocks are resident (max_resident_memory keeps them in memory)"
        if not self.blocks:
            return f"profile: no block was streamed in this call, so there was no read to time: {kept}."
        lines = ["| block | passes | read ms | wait ms | compute ms |", "|---|---|---|---|---|"]
        for index in sorted(self.blocks):
            t = self.blocks[index]
            lines.append(f"| {index} | {t.passes} | {1e3 * t.read:.1f} | {1e3 * t.wait:.1f} | {1e3 * t.compute:.1f} |")
        t = self.total
        lines.append(f"| all | {t.passes} | {1e3 * t.read:.1f} | {1e3 * t.wait:.1f} | {1e3 * t.compute:.1f} |")
        lines.append(f"\nread time hidden behind compute: {100 * self.hidden_share:.0f}%")
        if resident:
            lines.append(f"{kept} and not listed: {', '.join(map(str, resident))}.")
        return "\n".join(lines)
