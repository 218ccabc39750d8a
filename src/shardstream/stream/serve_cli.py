"""`shardstream serve`: the OpenAI-compatible HTTP API over one streaming model."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .cli import Device, Resident, Source, StorePath, open_model


def serve_command(
    source: Source,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model_name: Annotated[Optional[str], typer.Option(help="Model id reported by /v1/models.")] = None,
    max_resident_memory: Resident = "auto",
    device: Device = "cpu",
    store_path: StorePath = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models)."""
    import uvicorn

    from .server import create_app
    from .text import load_tokenizer

    with open_model(source, store_path, max_resident_memory, device) as model:
        app = create_app(model, load_tokenizer(model), model_name or source)
        uvicorn.run(app, host=host, port=port, log_level="warning")
