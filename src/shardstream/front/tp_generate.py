"""`shardstream generate --tensor-parallel`: run by torchrun on every rank; rank 0 prints the text.
(`serve --tensor-parallel` is in serve.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidOption

if TYPE_CHECKING:
    from ..options import ConversionOptions, Sampling
    from ..stream.engine_options import EngineOptions


def refuse_unsupported(unsupported: list[str]) -> None:
    """The options given that tensor parallelism does not take yet, refused by name."""
    if unsupported:
        raise InvalidOption(f"{', '.join(unsupported)} cannot be combined with --tensor-parallel yet; leave "
                            f"{'it' if len(unsupported) == 1 else 'them'} out.")


def open_rank(source: str, conversion: ConversionOptions, device: str, progress: bool, options: EngineOptions,
              tp_cache: str | None = None):
    """This rank's model, streaming its shares with `options` (cli.py command_options: what one process
    would take, for the same batches, out of the rank's share of the machine); a checkpoint is converted
    first with `conversion` (once per machine)."""
    from .auto import AutoModel

    return AutoModel.from_pretrained(source, device=device, progress=progress, tensor_parallel=True,
                                     tp_cache=tp_cache, options=options, conversion=conversion)


def generate_tp(source: str, prompt: str, sampling: Sampling, device: str, progress: bool, options: EngineOptions,
                conversion: ConversionOptions, tp_cache: str | None = None) -> None:
    """One prompt over the ranks, each streaming its shares with `options` (the command's, for one sequence)
    as generate streams a whole model; a checkpoint is converted with `conversion`, as generate converts
    one."""
    import torch.distributed as dist

    from ..serving.text import generate_one, load_tokenizer

    with open_rank(source, conversion, device, progress, options, tp_cache) as model:
        generate_one(model, load_tokenizer(model), prompt, **sampling.keywords(), prints=dist.get_rank() == 0)
