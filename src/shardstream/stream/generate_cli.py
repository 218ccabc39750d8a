"""`shardstream generate`: one prompt, tokens printed as they come."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .cli import Device, Resident, Source, StorePath, open_model


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
    from transformers import TextStreamer

    from .text import encode, load_tokenizer, sampling_options, set_seed

    with open_model(source, store_path, max_resident_memory, device, profile) as model:
        tokenizer = load_tokenizer(model)
        inputs = encode(tokenizer, prompt)
        options = sampling_options(max_new_tokens, temperature, top_p, tokenizer)
        set_seed(seed)
        model.generate(**inputs, **options, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
