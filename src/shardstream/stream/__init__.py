"""Layer-streaming inference: run a model larger than memory one block at a time.

The streaming engine: `StreamingModel`, `EngineOptions` and `EngineReport` (what `StreamingModel.report()`
returns) load on first use, so importing the package costs nothing until they are used. The user's entrance
(`AutoModel`, the `generate` and `serve` commands) is shardstream.front, above this package.
"""

__all__ = ["EngineOptions", "EngineReport", "StreamingModel"]


def __getattr__(name: str):
    if name == "AutoModel":   # the entrance stands above the engine: one sentence instead of a bare AttributeError
        raise AttributeError("AutoModel is `from shardstream import AutoModel` (shardstream.front.auto), not "
                             "shardstream.stream.AutoModel.")
    if name == "EngineOptions":
        from .engine_options import EngineOptions

        return EngineOptions
    if name == "EngineReport":
        from .report import EngineReport

        return EngineReport
    if name == "StreamingModel":
        from .model import StreamingModel

        return StreamingModel
    raise AttributeError(f"module 'shardstream.stream' has no attribute {name!r}")
