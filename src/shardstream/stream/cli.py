"""`shardstream generate` and `shardstream serve`; the lead mounts them on the main typer app."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from transformers import TextStreamer

from .model import AutoModel, StreamingModel
from .text import encode, load_tokenizer, sampling_options, set_seed

Source = Annotated[str, typer.Argument(help="Store folder, or a checkpoint (folder, URL, Hub id) to convert first.")]
StorePath = Annotated[Optional[str], typer.Option("--store-path", help="Where the store lives when converting.")]
Resident = Annotated[str, typer.Option(help="Bytes of blocks kept in memory: auto, 0 (pure streaming) or a size like 2GB.")]
Device = Annotated[str, typer.Option(help="cpu or cuda.")]


def open_model(source: str, store_path: str | None, max_resident_memory: str, device: str,
               profile: bool = False) -> StreamingModel:
    from ..cli import parse_size  # imported here: the main cli imports this module

    budget = "auto" if max_resident_memory == "auto" else parse_size(max_resident_memory, "--max-resident-memory")
    return AutoModel.from_pretrained(source, layer_shards_saving_path=store_path, device=device,
                                     max_resident_memory=budget, profiling_mode=profile)


def generate_command(
    source: Source,
    prompt: Annotated[str, typer.Option(help="Text to continue.")],
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 50,
    temperature: Annotated[float, typer.Option(help="0 = greedy; above 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.")] = None,
    max_resident_memory: Resident = "auto",
    device: Device = "cpu",
    store_path: StorePath = None,
    profile: Annotated[bool, typer.Option("--profile", help="Print per-block read/wait/compute times.")] = False,
) -> None:
    """Generate text from a prompt, printing tokens as they are produced."""
    with open_model(source, store_path, max_resident_memory, device, profile) as model:
        tokenizer = load_tokenizer(model)
        inputs = encode(tokenizer, prompt)
        options = sampling_options(max_new_tokens, temperature, top_p, tokenizer)
        set_seed(seed)
        model.generate(**inputs, **options, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))


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

    with open_model(source, store_path, max_resident_memory, device) as model:
        app = create_app(model, load_tokenizer(model), model_name or source)
        uvicorn.run(app, host=host, port=port, log_level="warning")
