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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import InvalidOption
from ..options import compression, size
from ..sizes import parse_size

if TYPE_CHECKING:
    from ..stream.engine_options import EngineOptions
    from ..stream.model import StreamingModel

Source = Annotated[str, typer.Argument(help="Store folder, or a checkpoint (folder, URL, Hub id) to convert first.")]
Resident = Annotated[str, typer.Option(help="Bytes of blocks kept in memory: auto, 0 (pure streaming) or a size like 2GB.",
                                       callback=size(auto=True))]
Device = Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")]
HostMemory = Annotated[str, typer.Option(help="With --device cuda: bytes of streamed blocks kept page-locked in host RAM after "
                                              "their first read, so a token only copies them to the GPU: auto (half the RAM "
                                              "available), 0 (read them every token) or a size like 16GB.",
                                         callback=size(auto=True))]
ComputeDtype = Annotated[str, typer.Option(help="Dtype the model computes in: auto (the checkpoint's where the device multiplies "
                                                "it fast, else float32; stderr says which and why), float32, bfloat16 or float16.")]
Experts = Annotated[str, typer.Option(help="MoE experts: with-block (read with their block) or on-demand (only those the router "
                                          "picks; the store's experts placed apart first: `shardstream shard STORE --experts`).")]
EXPERT_OPTIONS = {"with-block": "with_block", "on-demand": "on_demand"}
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Converting:
    """`shardstream convert`'s options, for when generate or serve is given a checkpoint (options.py)."""

    sequential: bool = False
    compression: str = "none"
    revision: str | None = None
    hf_token: str | None = None


def check_device(device: str) -> None:
    """--device before any weight is read: a typo or a missing GPU is one sentence, not a torch traceback."""
    if not DEVICE_PATTERN.fullmatch(device):
        raise InvalidOption(f"--device {device!r} is not a device shardstream runs on; use cpu, cuda or cuda:N.")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InvalidOption(f"--device {device} was given but CUDA is not available here; use --device cpu.")


def open_model(source: str, store_path: str | None, options: EngineOptions, device: str, progress: bool = True,
               converting: Converting | None = None, role: str = "") -> StreamingModel:
    """Load or convert the model (with `converting`'s options, which mean what they mean to `shardstream
    convert`) and open it with `options` (`command_options`: the command's, for its batch size). `role`
    ("draft") names the model in the lines it prints."""
    check_device(device)
    from .auto import AutoModel

    converting = converting or Converting()
    with _compute_dtype_to_stderr(options.compute_dtype, role):
        return AutoModel.from_pretrained(source, layer_shards_saving_path=store_path, device=device,
                                         sequential_shard_processing=converting.sequential,
                                         compression=compression(converting.compression),
                                         token=converting.hf_token, revision=converting.revision,
                                         progress=progress, options=options)


def command_options(max_resident_memory: str, max_host_memory: str, device: str, compute_dtype: str = "auto",
                    experts: str = "with-block", profile: bool = False, batch_size: int = 1) -> EngineOptions:
    """The engine options of a command's --max-resident-memory, --max-host-memory, --compute-dtype,
    --experts and --profile, checked before anything is read, for a model that runs `batch_size` sequences
    at once (EngineOptions.for_batch): the one value the command hands on, to its process's model or to its
    tensor-parallel rank (whose `auto` is its share of the machine, residency.auto_budget)."""
    from ..stream.compute_dtype import parse_compute_dtype
    from ..stream.engine_options import EngineOptions

    check_device(device)
    if experts not in EXPERT_OPTIONS:
        raise InvalidOption(f"--experts must be one of {', '.join(EXPERT_OPTIONS)}, not {experts!r}.")
    parse_compute_dtype(compute_dtype, "--compute-dtype")
    budget = _size_or_auto(max_resident_memory, "--max-resident-memory")
    host = _size_or_auto(max_host_memory, "--max-host-memory")
    if host not in ("auto", 0) and not device.startswith("cuda"):
        raise InvalidOption("--max-host-memory applies only with --device cuda; leave it out.")
    return EngineOptions(compute_dtype=compute_dtype, max_resident_memory=budget, max_host_memory=host,
                         experts=EXPERT_OPTIONS[experts], profiling_mode=profile).for_batch(batch_size, device)


def refuse_experts_with_tp(experts: str) -> None:
    """Tensor-parallel ranks hold whole experts with their blocks (docs/TENSOR_PARALLEL.md)."""
    if experts != "with-block":
        raise InvalidOption(f"--experts {experts} cannot be combined with --tensor-parallel; leave --experts out.")


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
