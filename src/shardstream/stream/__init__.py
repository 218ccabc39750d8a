"""Layer-streaming inference: run a model larger than memory one block at a time.

`AutoModel`, `StreamingModel` and `EngineOptions` load on first use, so the command modules in this package
(`cli.py`, `generate_cli.py`, `serve_cli.py`) import without torch and `shardstream --help` stays fast.
"""

__all__ = ["AutoModel", "EngineOptions", "StreamingModel"]


def __getattr__(name: str):
    if name == "AutoModel":
        from .auto import AutoModel

        return AutoModel
    if name == "EngineOptions":
        from .engine_options import EngineOptions

        return EngineOptions
    if name == "StreamingModel":
        from .model import StreamingModel

        return StreamingModel
    raise AttributeError(f"module 'shardstream.stream' has no attribute {name!r}")
