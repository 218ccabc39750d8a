"""A tensor-parallel rank: transformers' own model, built on `meta`, streamed from this rank's shares.

Every rank runs the whole forward pass on its share of each weight (layout.py), and hooks on the
split modules add the collectives the split needs: an all-reduce after each row-parallel Linear
(o_proj, down_proj) and after the vocabulary-split embedding (ids outside the rank's rows give
zeros), an all-gather of the vocabulary-split logits. Every rank then holds the same logits, so
`generate()` picks the same tokens on all of them; inputs and the random state come from rank 0.

The rank's shares are a store of their own (rankstore.py), opened by the streaming engine
(stream/model.py StreamingModel) with its split modules resized to the share shapes and its
attention told the rank's head counts: the same loader, prefetch, residency budget
(`max_resident_memory`), O_DIRECT reads and packed quantized products as one machine. All shares in
memory is the case where the budget holds every block.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InvalidOption
from ..store.reader import Store
from ..stream.engine_options import EngineOptions, engine_options
from ..stream.experts import ExpertSource, served_experts
from ..stream.habits import TransformersHabits
from ..stream.meta import WrapsModel, build_meta_model
from ..stream.model import StreamingModel
from ..stream.weights import WeightMapper
from .experts import RankExperts
from .group import check_same_store, each_machine_once, fingerprint, join_group, leave_group
from .layout import FUSED_QKV, Heads, Take
from .rankstore import exported_view, rank_folder, rank_layout


class TensorParallelModel(TransformersHabits, WrapsModel):
    """Call it like a transformers model (`model(ids).logits`, `model.generate(...)`), on every rank.

    `max_resident_memory`, `max_host_memory`, `prefetching`, `prefetch_depth`, `piece_bytes`,
    `verify_checksums`, `profiling_mode` and `max_seq_len` mean what they mean to a StreamingModel, for
    this rank's shares; `experts`: an MoE rank holds its experts with its blocks ("with_block"), or reads
    those of them the router picks from the store's expert files ("on_demand", a store whose experts
    `shardstream shard --experts` placed), cached as one process caches them; `tp_cache`: the folder the rank
    writes its shares to when the store has no export for this many ranks (default `<store>/tp`)."""

    def __init__(self, store: Store, options: EngineOptions | None = None, *, device: str | torch.device = "cpu",
                 tp_cache: str | os.PathLike | None = None, **engine):
        options = engine_options(options, engine)
        self.device = join_group(device)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        exported = check_same_store(store, self.size)
        self.store = store
        layout = rank_layout(store, build_meta_model(store, options.compute_dtype, self.device), self.rank, self.size)
        view = exported_view(store, layout, self.rank, self.size) if exported else None
        self.share_bytes_read = 0   # read from the store's files to write the rank's own (rankstore.py)
        on_demand = options.experts == "on_demand"
        # experts on demand: this rank's, read from the store's expert files as the router picks them
        mine = ExpertSource(store, range(layout.experts.first, layout.experts.first + layout.experts.count))
        if on_demand:
            served_experts(mine)   # refused here, before the rank writes its folder
        if view is None:
            view, self.share_bytes_read = rank_folder(store, layout, self.rank, self.size, fingerprint(store), tp_cache,
                                                      experts=not on_demand)
        self.rank_store = view
        self._hooks: list = []

        def split(model: nn.Module) -> None:
            _resize(model, layout.shares)
            _localize_attention(model, layout.roles, layout.heads)
            # MoE: this rank's whole experts, the picks of the others sent nowhere (experts.py)
            self._hooks += RankExperts(model, WeightMapper(model), store, self.rank, self.size).localize()

        self._streaming = StreamingModel(view, options, device=self.device, shape_model=split,
                                         experts_from=mine if on_demand else None)
        self.experts = self._streaming.experts
        self.model = self._streaming.model
        self._hooks += _add_collectives(self.model, layout.roles, self.rank, self.size)

    @property
    def bytes_read(self) -> int:
        """Weight bytes this rank read: its shares from the store (when it wrote its own files), then its
        files as the streaming engine reads them (resident parts once, streamed blocks every pass)."""
        return self.share_bytes_read + self._streaming.bytes_read

    @property
    def forward_passes(self) -> int:
        """Passes over the blocks in the last call (StreamingModel.forward_passes)."""
        return self._streaming.forward_passes

    @property
    def resident_blocks(self) -> list[int]:
        return self._streaming.resident_blocks

    @property
    def resident_budget(self) -> int:
        """Bytes this rank's resident blocks were chosen within (StreamingModel.resident_budget)."""
        return self._streaming.resident_budget

    @property
    def closed(self) -> bool:
        return self._streaming.closed

    # -- the transformers surface ------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor | None = None, **kwargs):
        """One forward pass on every rank; rank 0's `input_ids` (and attention mask) are used."""
        self.check_open()
        input_ids, kwargs = self._from_rank_0(input_ids, kwargs)
        return self._streaming(input_ids, **kwargs)

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """transformers' `generate` on every rank; rank 0's inputs and random state (sampling) are used."""
        self.check_open()
        input_ids, kwargs = self._from_rank_0(input_ids, kwargs, random_state=True)
        new_tokens = kwargs.get("max_new_tokens") or self.model.generation_config.max_new_tokens or 0
        self._streaming.check_length(input_ids, new_tokens)
        if kwargs.get("use_cache", True) and "prefill_chunk_size" not in kwargs:
            # every rank must run the same passes: the smallest chunk any rank's memory allows
            chunk = torch.tensor([self._streaming.prefill_chunk(input_ids.shape[0], input_ids.shape[-1], new_tokens)],
                                 device=self.device)
            dist.all_reduce(chunk, op=dist.ReduceOp.MIN)
            kwargs["prefill_chunk_size"] = int(chunk) if int(chunk) < input_ids.shape[-1] else None
        return self._streaming.generate(input_ids, **kwargs)

    def _from_rank_0(self, input_ids: torch.Tensor | None, kwargs: dict, random_state: bool = False):
        mask = kwargs.get("attention_mask")
        shared = [[None if t is None else t.cpu() for t in (input_ids, mask)],
                  torch.get_rng_state() if random_state else None]
        dist.broadcast_object_list(shared, src=0)
        (input_ids, mask), state = shared
        if state is not None:
            torch.set_rng_state(state)
        if input_ids is None:
            raise InvalidOption("rank 0 gave no input_ids; pass the token ids to the model on every rank.")
        if mask is not None:
            kwargs = {**kwargs, "attention_mask": mask.to(self.device)}
        return input_ids.to(self.device), kwargs

    def close(self) -> None:
        """Drop the hooks, stop the streaming engine; leave the process group (if this model started it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._streaming.close()
        leave_group()

    def __enter__(self) -> TensorParallelModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resize(model: nn.Module, shares: dict[str, Take]) -> None:
    """The split parameters on `meta` in their share's shape (a tied head follows its embedding), so that
    the streaming engine sizes, reads and fills them as the rank's."""
    mapper = WeightMapper(model)
    new: dict[str, nn.Parameter] = {}
    for key, share in shares.items():
        if share.dim is None:
            continue
        (name,) = mapper.target_names([key])
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        old = module._parameters[attr]
        shape = list(old.shape)
        shape[share.dim] = share.size()
        new[name] = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=False)
    for tied, source in getattr(model, "all_tied_weights_keys", {}).items():
        if source in new and tied not in new:
            new[tied] = new[source]
    for name, parameter in new.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = parameter
        if isinstance(module, nn.Linear) and attr == "weight":
            module.out_features, module.in_features = parameter.shape
        elif isinstance(module, nn.Embedding):
            module.num_embeddings = parameter.shape[0]


def _localize_attention(model: nn.Module, roles: dict[str, str], heads: Heads) -> None:
    """Attention modules see their rank's head counts (code that reads them from the config too)."""
    for name in roles:
        parent, _, leaf = name.rpartition(".")
        if leaf not in ("q_proj", FUSED_QKV):
            continue
        attention = model.get_submodule(parent)
        attention.config = copy.copy(attention.config)
        attention.config.num_attention_heads = heads.q_count
        attention.config.num_key_value_heads = heads.kv_count
        attention.num_key_value_groups = heads.q_count // heads.kv_count
        for attribute, value in (("num_key_value_heads", heads.kv_count), ("num_heads", heads.q_count)):
            if hasattr(attention, attribute):
                setattr(attention, attribute, value)


def _add_collectives(model: nn.Module, roles: dict[str, str], rank: int, size: int) -> list:
    hooks = []
    for name, role in roles.items():
        module = model.get_submodule(name)
        if role == "row":
            hooks.append(module.register_forward_hook(_all_reduce))
        elif role == "head":
            hooks.append(module.register_forward_hook(_gather_vocabulary(size)))
        elif role == "vocab":
            module.padding_idx = None   # only gradients use it, and it may lie outside this rank's rows
            rows = module.weight.shape[0]
            pre, post = _vocabulary_lookup(rank * rows, (rank + 1) * rows)
            # before the streaming engine's own hooks: an embedding read by rows reads the rank's rows
            hooks += [module.register_forward_pre_hook(pre, prepend=True), module.register_forward_hook(post)]
    return hooks


def _all_reduce(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """A row-parallel Linear's partial sums -> the full output on every rank."""
    dist.all_reduce(output)
    return output


def _gather_vocabulary(size: int) -> Callable:
    def gather(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        """Each rank's logits for its vocabulary rows -> all the logits, in vocabulary order."""
        pieces = [torch.empty_like(output) for _ in range(size)]
        dist.all_gather(pieces, output.contiguous())
        return torch.cat(pieces, dim=-1)
    return gather


def _vocabulary_lookup(start: int, stop: int) -> tuple[Callable, Callable]:
    """Hooks for an embedding holding rows [start, stop): other ids look up row 0 and are zeroed, then
    the ranks' embeddings are summed (each id is in exactly one rank's rows)."""
    outside: list[torch.Tensor] = []

    def local_ids(module: nn.Module, args):
        ids = args[0]
        out = (ids < start) | (ids >= stop)
        outside[:] = [out]
        return ((ids - start).masked_fill(out, 0), *args[1:])

    def summed(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        output = output.masked_fill(outside.pop().unsqueeze(-1), 0)
        dist.all_reduce(output)
        return output

    return local_ids, summed


def open_tensor_parallel(open_store: Callable[[], Store], device: str | torch.device, options: EngineOptions,
                         tp_cache: str | os.PathLike | None = None) -> TensorParallelModel:
    """Join the group, open (or convert) the store once per machine, then build this rank's model."""
    join_group(device)
    return TensorParallelModel(each_machine_once(open_store), options, device=device, tp_cache=tp_cache)
