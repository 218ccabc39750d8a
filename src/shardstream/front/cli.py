"""Options and model opening shared by `shardstream generate` and `shardstream serve`.

The commands themselves live in `generate_cli.py` and `serve_cli.py`; the main app mounts them.
Nothing heavy (torch, transformers) is imported at module level, so `shardstream --help` is fast.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import InvalidOption
from ..options import DEVICE_PATTERN, EXPERT_OPTIONS
from ..sizes import parse_size

if TYPE_CHECKING:
    from ..options import ConversionOptions, EngineFlags
    from ..stream.engine_options import EngineOptions
    from ..stream.model import StreamingModel

Source = Annotated[str, typer.Argument(help="Store folder, or a checkpoint (folder, URL, Hub id) to convert first.")]


def check_device(device: str) -> None:
    """--device before any weight is read: a typo or a missing GPU is one sentence, not a torch traceback."""
    if not re.fullmatch(DEVICE_PATTERN, device):
        raise InvalidOption(f"--device {device!r} is not a device shardstream runs on; use cpu, cuda or cuda:N.")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InvalidOption(f"--device {device} was given but CUDA is not available here; use --device cpu.")


def open_model(source: str, conversion: ConversionOptions, options: EngineOptions, device: str,
               progress: bool = True, role: str = "") -> StreamingModel:
    """Load the model, or convert it first with `conversion` (the options that mean what they mean to
    `shardstream convert`), and open it with `options` (`command_options`: the command's, for its batch
    size). `role` ("draft") names the model in the lines it prints."""
    check_device(device)
    from .auto import AutoModel

    with _compute_dtype_to_stderr(options.compute_dtype, role):
        return AutoModel.from_pretrained(source, device=device, progress=progress, options=options,
                                         conversion=conversion)


def command_options(flags: EngineFlags, batch_size: int = 1) -> EngineOptions:
    """The engine options of a command's engine flags, checked before anything is read, for a model that
    runs `batch_size` sequences at once (EngineOptions.for_batch): the one value the command hands on, to
    its process's model or to its tensor-parallel rank (whose `auto` is its share of the machine,
    residency.auto_budget)."""
    from ..stream.compute_dtype import parse_compute_dtype
    from ..stream.engine_options import EngineOptions

    check_device(flags.device)
    parse_compute_dtype(flags.compute_dtype, "--compute-dtype")
    budget = _size_or_auto(flags.max_resident_memory, "--max-resident-memory")
    host = _size_or_auto(flags.max_host_memory, "--max-host-memory")
    if host not in ("auto", 0) and not flags.device.startswith("cuda"):
        raise InvalidOption("--max-host-memory applies only with --device cuda; leave it out.")
    held = _size_or_auto(flags.max_expert_memory, "--max-expert-memory")
    if held != "auto" and flags.experts != "on-demand":
        raise InvalidOption("--max-expert-memory applies only with --experts on-demand; leave it out.")
    options = EngineOptions(compute_dtype=flags.compute_dtype, max_resident_memory=budget, max_host_memory=host,
                            experts=EXPERT_OPTIONS[flags.experts], max_expert_memory=held, profiling_mode=flags.profile)
    return options.for_batch(batch_size, flags.device)


def _size_or_auto(value: str, flag: str) -> int | str:
    """A memory flag's text as EngineOptions takes it: 'auto', or bytes."""
    return "auto" if value == "auto" else parse_size(value, flag)


@contextlib.contextmanager
def _compute_dtype_to_stderr(option: str, role: str = "") -> Iterator[None]:
    """Check --compute-dtype before any conversion; while the model loads, its choice (and why) goes to
    stderr as one line (the logger is left as it was: tests call the commands in-process)."""
    from ..stream.compute_dtype import log, parse_compute_dtype

    parse_compute_dtype(option, "--compute-dtype")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"shardstream: {role + ': ' if role else ''}%(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
