"""shardstream: run and train large language models on hardware too small for them."""

from . import sepweight
from .convert import convert
from .store import open_store

__version__ = "0.1.0"
__all__ = ["AutoModel", "convert", "open_store", "sepweight"]


def __getattr__(name: str):
    """`shardstream.AutoModel` without importing the streaming runtime for every command."""
    if name == "AutoModel":
        from .stream import AutoModel

        return AutoModel
    raise AttributeError(f"module 'shardstream' has no attribute {name!r}")
