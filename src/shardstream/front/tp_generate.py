"""`shardstream generate --tensor-parallel`: run by torchrun on every rank; rank 0 prints the text.
(`serve --tensor-parallel` is in serve.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidOption
from ..options import compression
from .cli import Converting

if TYPE_CHECKING:
    from ..stream.engine_options import EngineOptions


def refuse_unsupported(unsupported: list[str]) -> None:
    """The options given that tensor parallelism does not take yet, refused by name."""
    if unsupported:
        raise InvalidOption(f"{', '.join(unsupported)} cannot be combined with --tensor-parallel yet; leave "
                            f"{'it' if len(unsupported) == 1 else 'them'} out.")


def open_rank(source: str, store_path: str | None, device: str, converting: Converting, progress: bool,
              options: EngineOptions, tp_cache: str | None = None):
    """This rank's model, streaming its shares with `options` (cli.py command_options: what one process
    would take, for the same batches, out of the rank's share of the machine); a checkpoint is converted
    first with `converting`'s options (once per machine)."""
    from .auto import AutoModel

    return AutoModel.from_pretrained(source, layer_shards_saving_path=store_path, device=device,
                                     sequential_shard_processing=converting.sequential,
                                     compression=compression(converting.compression), token=converting.hf_token,
                                     revision=converting.revision, progress=progress, tensor_parallel=True,
                                     tp_cache=tp_cache, options=options)


def generate_tp(source: str, prompt: str, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                seed: int | None, stops: list[str], device: str, store_path: str | None, progress: bool,
                options: EngineOptions, converting: Converting, tp_cache: str | None = None) -> None:
    """One prompt over the ranks, each streaming its shares with `options` (the command's, for one sequence)
    as generate streams a whole model; a checkpoint is converted with `converting`'s options, as generate
    converts one."""
    import torch.distributed as dist

    from ..serving.text import generate_one, load_tokenizer

    with open_rank(source, store_path, device, converting, progress, options, tp_cache) as model:
        generate_one(model, load_tokenizer(model), prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, seed=seed, stops=stops, prints=dist.get_rank() == 0)
