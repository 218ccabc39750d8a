"""`AutoModel.from_pretrained`: the front door. It converts a checkpoint into a store when one is named,
then opens it as one streaming model, or as this process's rank of a tensor-parallel group."""

from __future__ import annotations

import os

import torch

from ..errors import InvalidOption
from ..options import ConversionOptions, conversion_options
from ..store import Store
from .airllm_compat import hub_token, refuse_training_switches
from ..stream.engine_options import EngineOptions
from ..stream.model import StreamingModel
from .resolve import ensure_store


class AutoModel:
    """`AutoModel.from_pretrained(...)`: convert if needed, then stream."""

    @staticmethod
    def from_pretrained(
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        layer_shards_saving_path: str | os.PathLike | None = None,
        sequential_shard_processing: bool = False,
        compression: str | None = None,
        delete_original: bool = False,
        profiling_mode: bool = False,
        prefetching: bool = True,
        prefetch_depth: int | str = "auto",
        device: str | torch.device = "cpu",
        max_resident_memory: int | str | None = "auto",
        verify_checksums: bool = True,
        dtype: torch.dtype | None = None,
        compute_dtype: str | torch.dtype = "auto",
        experts: str = "with_block",
        max_expert_memory: int | str | None = "auto",
        token: str | None = None,
        revision: str | None = None,
        progress: bool = True,
        piece_bytes: int | None = None,
        max_host_memory: int | str | None = "auto",
        max_seq_len: int | None = None,
        hf_token: str | None = None,
        install_hooks: bool = True,
        load_resident: bool = True,
        tensor_parallel: bool = False,
        tp_cache: str | os.PathLike | None = None,
        options: EngineOptions | None = None,
        conversion: ConversionOptions | None = None,
    ) -> StreamingModel:
        """Open (or first convert into) the store, then build the streaming model over it.

        `pretrained_model_name_or_path` is a Hub id, an HTTP(S) base URL, a checkpoint folder or a
        store folder; `layer_shards_saving_path` is where the store lives (default
        ~/.cache/shardstream/<slug>). The converter options apply only when a conversion runs.
        `experts="on_demand"` reads only the MoE experts the router picks, from their tiers (see
        docs/SHARDING.md); the store's experts must have been placed with `place_experts`.
        `max_expert_memory` (with experts="on_demand"): bytes of experts kept in memory between passes, those
        routed to often and lately ('auto': 3/4 of the memory left once the model is placed, their reading
        included, and where that holds every expert all are read at load); a pass reads the routed experts
        not kept, one at a time.
        `piece_bytes`: the most bytes of a streamed block's big modules in memory at once (pieces.py;
        default 64 MiB; a batch engine's model passes 16 MiB, leaving memory to its KV caches).
        `max_host_memory` (device="cuda" only): bytes of the streamed blocks kept page-locked in host RAM
        after their first read, so that a token only copies them to the GPU ('auto': half the RAM
        available; 0: read every token).
        `max_seq_len`: the longest prompt plus new tokens a call may run (default: the model's context).
        AirLLM 4.0's parameters are all taken (docs/STREAMING.md has the table): `hf_token` is `token`,
        and `install_hooks`/`load_resident`, its switches for LoRA training, are refused when False.
        `tensor_parallel=True`: this process is one rank of a torchrun group (or of an initialized
        torch.distributed group); it reads and runs only its share of the weights (docs/TENSOR_PARALLEL.md),
        streamed with the options above as one machine streams the whole model (`experts` aside); `tp_cache`:
        where a rank writes its shares when the store has no `shardstream shard --tp N` export (default
        `<store>/tp`).
        `compute_dtype`: the dtype the model computes in; 'auto' keeps the checkpoint's where the device
        multiplies it fast, else float32 math on the weights held as stored (compute_dtype.py,
        half_linear.py); 'float32', 'bfloat16', 'float16' or a torch dtype force one. `dtype`
        (AirLLM's name) is the same option and wins when given.
        `options`: the engine's options (compute dtype to profiling above) as one EngineOptions value, given
        instead of one by one. `conversion`: the store's folder and the converter's options
        (`layer_shards_saving_path`, `sequential_shard_processing`, `compression`, `token`, `revision`) as one
        ConversionOptions value, likewise.
        """
        token = hub_token(token, hf_token)
        refuse_training_switches(install_hooks, load_resident)
        # every engine option checked once, before any conversion
        given = EngineOptions(compute_dtype=compute_dtype if dtype is None else dtype, prefetching=prefetching,
                                prefetch_depth=prefetch_depth, max_resident_memory=max_resident_memory,
                                max_host_memory=max_host_memory, max_expert_memory=max_expert_memory,
                                piece_bytes=piece_bytes, verify_checksums=verify_checksums, experts=experts,
                                max_seq_len=max_seq_len, profiling_mode=profiling_mode)
        if options is not None and given != EngineOptions():
            raise InvalidOption("give the engine's options as `options` or one by one, not both.")
        options = options or given
        conversion = conversion_options(conversion, ConversionOptions(
            store_path=layer_shards_saving_path, sequential=sequential_shard_processing, compression=compression,
            revision=revision, hf_token=token))

        def open_store() -> Store:
            return ensure_store(pretrained_model_name_or_path, conversion, delete_original=delete_original,
                                profiling_mode=options.profiling_mode, progress=progress)

        if tensor_parallel:
            from ..tp.model import open_tensor_parallel

            return open_tensor_parallel(open_store, device, options, tp_cache=tp_cache)
        if tp_cache is not None:
            raise InvalidOption("tp_cache goes with tensor_parallel=True; leave it out.")
        return StreamingModel(open_store(), options, device=device)
