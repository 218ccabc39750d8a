"""Training data distribution: a dataset cut into blocks and chunks, handed out by a chunk tracker.

The torch-free parts are importable from here; the training loop lives in `shardstream.data.launch`
(`train(TrainConfig(...))`) so that tracker tools do not pay for importing torch.
"""

from shardstream.data.blocks import BlockInfo, BlockManager
from shardstream.data.tracker import ChunkTracker, Claim, EpochStatus, open_tracker

__all__ = ["BlockInfo", "BlockManager", "ChunkTracker", "Claim", "EpochStatus", "open_tracker"]
