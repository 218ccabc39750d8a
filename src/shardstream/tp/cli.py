"""`shardstream generate --tensor-parallel`: run by torchrun on every rank; rank 0 prints the text."""

from __future__ import annotations

from ..errors import InvalidOption
from ..stream.cli import Converting


def generate_tp(source: str, prompt: str | None, max_new_tokens: int, temperature: float, top_p: float,
                top_k: int, seed: int | None, stops: list[str], device: str, store_path: str | None,
                progress: bool, unsupported: list[str], compute_dtype: str, converting: Converting,
                max_resident_memory: str = "auto", max_host_memory: str = "auto", tp_cache: str | None = None) -> None:
    """One prompt over the ranks, each streaming its shares within `max_resident_memory` (and, on a GPU,
    `max_host_memory`) as generate streams a whole model; `unsupported` names the options given that TP
    does not take; a checkpoint is converted with `converting`'s options, as generate converts one."""
    if unsupported:
        raise InvalidOption(f"{', '.join(unsupported)} cannot be combined with --tensor-parallel yet; leave "
                            f"{'it' if len(unsupported) == 1 else 'them'} out.")
    if prompt is None:
        raise InvalidOption("--tensor-parallel answers one --prompt; give --prompt TEXT.")
    import torch.distributed as dist

    from ..stream.cli import open_model
    from ..serving.stops import stop_streamer
    from ..serving.text import encode, load_tokenizer, sampling_options, set_seed

    with open_model(source, store_path, max_resident_memory, device, progress=progress, max_host_memory=max_host_memory,
                    converting=converting, compute_dtype=compute_dtype, tensor_parallel=True,
                    tp_cache=tp_cache) as model:
        tokenizer = load_tokenizer(model)
        inputs = encode(tokenizer, prompt)
        options = sampling_options(max_new_tokens, temperature, top_p, tokenizer, top_k)
        if stops:
            options.update(stop_strings=stops, tokenizer=tokenizer)
        set_seed(seed)
        streamer = stop_streamer(tokenizer, stops) if dist.get_rank() == 0 else None
        model.generate(**inputs, **options, streamer=streamer)
