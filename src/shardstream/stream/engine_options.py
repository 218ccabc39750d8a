"""How the streaming engine runs a model, as one value checked once.

`AutoModel.from_pretrained`, the `generate` and `serve` commands, a tensor-parallel rank and the
speculative draft all open the same engine; they build an `EngineOptions` and hand it on, so an option
means the same on every path and a mistyped one is refused before anything is converted or read. A
batch (serve, offline generate) runs with `for_batch`, the memory policy that leaves room for its KV
caches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import InvalidOption
from ..memory import available_memory, gpu_free_bytes
from .compute_dtype import parse_compute_dtype
from . import pieces
from .residency import AUTO_SHARE, HOST_SHARE, auto_budget, batch_auto_budget, bytes_option

EXPERT_MODES = ("with_block", "on_demand")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's options (docs/STREAMING.md and `AutoModel.from_pretrained` say what each does): memory
    budgets ('auto', None for no limit, or bytes), the compute dtype, read-ahead, pieces, checksums, MoE
    experts, the longest call and per-block profiling."""

    compute_dtype: str | torch.dtype | None = "auto"
    max_resident_memory: int | str | None = "auto"
    max_host_memory: int | str | None = "auto"
    max_expert_memory: int | str | None = "auto"
    prefetching: bool = True
    prefetch_depth: int | str = "auto"
    piece_bytes: int | None = None
    verify_checksums: bool = True
    experts: str = "with_block"
    max_seq_len: int | None = None
    profiling_mode: bool = False

    def __post_init__(self) -> None:
        parse_compute_dtype(self.compute_dtype)
        for name in ("max_resident_memory", "max_host_memory", "max_expert_memory"):
            if getattr(self, name) != "auto":
                bytes_option(name, getattr(self, name))
        if self.prefetch_depth != "auto" and (isinstance(self.prefetch_depth, bool)
                                              or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1):
            raise InvalidOption(f"prefetch_depth must be 'auto' or a number of pieces >= 1, not {self.prefetch_depth!r}.")
        if self.piece_bytes is not None and (isinstance(self.piece_bytes, bool) or not isinstance(self.piece_bytes, int)
                                             or self.piece_bytes < 1):
            raise InvalidOption(f"piece_bytes must be None or a number of bytes >= 1, not {self.piece_bytes!r}.")
        if self.experts not in EXPERT_MODES:
            raise InvalidOption(f"experts must be one of {', '.join(EXPERT_MODES)}, not {self.experts!r}.")
        if self.max_expert_memory != "auto" and self.experts != "on_demand":
            raise InvalidOption("max_expert_memory applies only with experts='on_demand'; leave it out.")
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int)
                                             or self.max_seq_len < 1):
            raise InvalidOption(f"max_seq_len must be at least 1, not {self.max_seq_len}.")

    def for_batch(self, batch_size: int, device: torch.device | str) -> EngineOptions:
        """These options for a model that runs `batch_size` sequences at once: for more than one, `auto`
        residency, the experts held on demand and the pieces leave memory to the KV caches (residency.py,
        pieces.py); one sequence keeps them as they are."""
        if batch_size < 1:
            raise InvalidOption(f"batch_size must be at least 1, not {batch_size}.")
        if batch_size == 1:
            return self
        share = batch_auto_budget(device)
        return replace(self,
                       max_resident_memory=share if self.max_resident_memory == "auto" else self.max_resident_memory,
                       max_expert_memory=share if self.experts == "on_demand" and self.max_expert_memory == "auto"
                       else self.max_expert_memory,
                       piece_bytes=pieces.BATCH_PIECE_BYTES if self.piece_bytes is None else self.piece_bytes)

    def resident_budget(self, fixed_bytes: int, device: torch.device | str | None = None) -> int:
        """Bytes of blocks to keep resident on `device` under `max_resident_memory` (the streamed blocks'
        working set comes out of it too): residency.auto_budget for 'auto'; None: no limit, every block stays."""
        if self.max_resident_memory == "auto":
            return auto_budget(fixed_bytes, device)
        return bytes_option("max_resident_memory", self.max_resident_memory)

    def host_budget(self, device: torch.device | str) -> int:
        """Bytes of streamed pieces a model on a GPU keeps page-locked in host RAM after their first read
        (`max_host_memory`; None: no limit), so that a token only copies them to the GPU
        (loader.BlockLoader._reserve). 'auto' = HOST_SHARE of the RAM available. On the CPU there is nothing to
        copy: only 'auto' or 0 is accepted."""
        if not str(device).startswith("cuda"):
            if self.max_host_memory not in ("auto", 0):
                raise InvalidOption("max_host_memory applies only with device='cuda'; on the CPU, max_resident_memory "
                                    "keeps blocks in RAM. Leave it out.")
            return 0
        if self.max_host_memory == "auto":
            return int(available_memory()[0] * HOST_SHARE)
        return bytes_option("max_host_memory", self.max_host_memory)

    def expert_budget(self, device: torch.device | str, streaming_bytes: int) -> int:
        """Bytes for MoE experts read on demand (experts='on_demand', experts.py): `max_expert_memory` itself,
        None for no limit; 'auto': AUTO_SHARE of the memory left once the resident parts are loaded, less
        `streaming_bytes` (the streamed pieces in flight), for the experts and their reading together; on a
        GPU, of the GPU's free memory."""
        if self.max_expert_memory != "auto":
            return bytes_option("max_expert_memory", self.max_expert_memory)
        if str(device).startswith("cuda"):
            return int(gpu_free_bytes(device) * AUTO_SHARE)
        return max(0, int((available_memory()[0] - streaming_bytes) * AUTO_SHARE))


def engine_options(options: EngineOptions | None, given: dict) -> EngineOptions:
    """`options`, or the options given one by one (EngineOptions' fields); both at once are refused."""
    if options is None:
        return EngineOptions(**given)
    if given:
        raise InvalidOption(f"give the engine's options as `options` or one by one, not both: "
                            f"{', '.join(sorted(given))} beside `options`.")
    return options
