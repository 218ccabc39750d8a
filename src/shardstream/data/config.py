"""Everything a training run is told, in one frozen value that pickles into worker processes.

Kept free of torch so the CLI and tracker tools start fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from shardstream.data.blocks import DEFAULT_CHUNK_SIZE, DEFAULT_SAMPLES_PER_BLOCK, BlockManager

# Steps between checkpoints: a chunk counts as done only once a saved checkpoint holds it.
DEFAULT_SAVE_EVERY = 500


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardstream" / "data"


@dataclass(frozen=True)
class TrainConfig:
    model: str
    dataset: str
    output: Path
    tokenizer: str | None = None
    tracker: str | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    text_field: str = "text"
    samples_per_block: int = DEFAULT_SAMPLES_PER_BLOCK
    chunk_size: int = DEFAULT_CHUNK_SIZE
    steps: int | None = None
    iterate: bool = False
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 3e-4
    workers: int = 1
    cuda_ids: tuple[int, ...] = ()
    ddp: bool = False
    nproc: int = 2
    lease_seconds: float = 60.0
    save_every: int = DEFAULT_SAVE_EVERY
    log_file: Path | None = None
    seed: int = 0

    @property
    def tracker_url(self) -> str:
        return self.tracker or str(self.output / "chunk_tracker.sqlite")

    @property
    def processes(self) -> int:
        return self.nproc if self.ddp else self.workers

    def device(self, index: int) -> str:
        return f"cuda:{self.cuda_ids[index % len(self.cuda_ids)]}" if self.cuda_ids else "cpu"

    def block_manager(self) -> BlockManager:
        return BlockManager(self.dataset, self.cache_dir, self.samples_per_block, self.chunk_size, self.text_field)
