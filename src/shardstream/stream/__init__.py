"""Layer-streaming inference: run a model larger than memory one block at a time."""

from .model import AutoModel, StreamingModel

__all__ = ["AutoModel", "StreamingModel"]
