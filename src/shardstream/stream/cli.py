"""Options and model opening shared by `shardstream generate` and `shardstream serve`.

The commands themselves live in `generate_cli.py` and `serve_cli.py`; the main app mounts them.
Nothing heavy (torch, transformers) is imported at module level, so `shardstream --help` is fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from .model import StreamingModel

Source = Annotated[str, typer.Argument(help="Store folder, or a checkpoint (folder, URL, Hub id) to convert first.")]
StorePath = Annotated[Optional[str], typer.Option("--store-path", help="Where the store lives when converting.")]
Resident = Annotated[str, typer.Option(help="Bytes of blocks kept in memory: auto, 0 (pure streaming) or a size like 2GB.")]
Device = Annotated[str, typer.Option(help="cpu or cuda.")]


def open_model(source: str, store_path: str | None, max_resident_memory: str, device: str,
               profile: bool = False) -> StreamingModel:
    from ..cli import parse_size  # imported here: the main cli imports this module
    from .model import AutoModel

    budget = "auto" if max_resident_memory == "auto" else parse_size(max_resident_memory, "--max-resident-memory")
    return AutoModel.from_pretrained(source, layer_shards_saving_path=store_path, device=device,
                                     max_resident_memory=budget, profiling_mode=profile)
