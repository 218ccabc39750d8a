"""A tensor-parallel rank: transformers' own model, built on `meta`, filled with this rank's shares.

Every rank runs the whole forward pass on its share of each weight (layout.py), and hooks on the
split modules add the collectives the split needs: an all-reduce after each row-parallel Linear
(o_proj, down_proj) and after the vocabulary-split embedding (ids outside the rank's rows give
zeros), an all-gather of the vocabulary-split logits. Every rank then holds the same logits, so
`generate()` picks the same tokens on all of them; inputs and the random state come from rank 0.
All of a rank's shares stay in memory (no layer streaming).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InvalidOption, UnsupportedModel
from ..serving.text import check_context
from ..store.reader import Store
from ..store.sharding import load_index
from ..stream.meta import build_meta_model
from ..stream.weights import Slots, WeightMapper
from .experts import RankExperts
from .group import check_same_store, each_machine_once, join_group, leave_group
from .layout import FUSED_QKV, Heads, Take, is_exported_block, rank_heads, take, tp_roles
from .reading import ShareReader


class TensorParallelModel:
    """Call it like a transformers model (`model(ids).logits`, `model.generate(...)`), on every rank."""

    def __init__(self, store: Store, *, device: str | torch.device = "cpu",
                 compute_dtype: str | torch.dtype | None = "auto"):
        if store.manifest.compression:
            raise InvalidOption(
                f"the store at {store.root} is {store.manifest.compression}-quantized, and tensor parallelism runs "
                "unquantized stores only; convert the checkpoint again without --compression."
            )
        self.device = join_group(device)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        exported = check_same_store(store, self.size)
        self.store = store
        self.model = build_meta_model(store, compute_dtype, self.device)
        roles = tp_roles(self.model)
        heads = rank_heads(self.model.config, self.rank, self.size)
        mapper = WeightMapper(self.model)
        experts = RankExperts(self.model, mapper, store, self.rank, self.size)   # MoE: this rank's whole experts
        shares = {k: s for k, s in self._shares(mapper, roles, heads).items() if k not in experts.stored}
        self.bytes_read = 0
        if exported and self._exported_fit(shares):
            tensors = self._read_exported(shares)
        else:
            tensors = self._read_shares(shares)
        tensors.update(experts.read())
        self.bytes_read += experts.bytes_read
        self._fill(mapper, tensors)
        self._localize_attention(roles, heads)
        self._hooks = self._add_collectives(roles) + experts.localize()

    # -- reading -----------------------------------------------------------------------------

    def _shares(self, mapper: WeightMapper, roles: dict[str, str], heads: Heads) -> dict[str, Take]:
        """Stored tensor name -> this rank's share of it (the layout of the parameter it fills)."""
        shares = {}
        for key in self.store.manifest.tensors:
            names = mapper.target_names([key])
            if len(names) != 1:
                continue   # nothing to fill (e.g. an old rotary buffer); a converted one is caught by _fill
            module, _, kind = next(iter(names)).rpartition(".")
            shares[key] = take(module, roles.get(module), kind, self.store.manifest.tensors[key].shape,
                               self.model.config, heads, self.rank, self.size)
        return shares

    def _exported_fit(self, shares: dict[str, Take]) -> bool:
        """Whether `shardstream shard --tp` wrote this rank exactly its shares (not so for fused
        projections, written as one block of rows, nor for replicated KV heads)."""
        written = {s.tensor: s.split_dim for s in load_index(self.store).slices if s.rank == self.rank and s.count == self.size}
        return all(key in written and is_exported_block(share, written[key], self.store.manifest.tensors[key].shape,
                                                        self.rank, self.size)
                   for key, share in shares.items())

    def _read_exported(self, shares: dict[str, Take]) -> dict[str, torch.Tensor]:
        """Each part's rank file, checksum-verified (Store.load with tp_rank)."""
        index = load_index(self.store)
        tensors: dict[str, torch.Tensor] = {}
        for part in self.store.parts:
            tensors.update(self.store.load(part, tp_rank=self.rank, tp_size=self.size))
            self.bytes_read += sum(index.files[f].size for f in {s.file for s in index.slices
                                                                 if s.part == part and s.rank == self.rank and s.count == self.size})
        return {k: torch.zeros_like(t) if k in shares and shares[k].zeros else t for k, t in tensors.items()}

    def _read_shares(self, shares: dict[str, Take]) -> dict[str, torch.Tensor]:
        """Only the rank's bytes of each tensor, from the converter's part files (tied tensors once)."""
        reader = ShareReader(self.store)
        tensors = {key: reader.read(self.store.manifest.tensors[key], share) for key, share in shares.items()}
        for alias, info in self.store.manifest.aliases.items():
            if info["target"] in tensors:
                tensors[alias] = tensors[info["target"]]
        self.bytes_read = reader.bytes_read
        return tensors

    def _fill(self, mapper: WeightMapper, tensors: dict[str, torch.Tensor]) -> None:
        params = mapper.convert(tensors)
        for tied, source in getattr(self.model, "all_tied_weights_keys", {}).items():
            if tied not in params and source in params:
                params[tied] = params[source]
        slots = Slots(self.model)
        missing = slots.names - params.keys()
        if missing:
            raise UnsupportedModel(
                f"the store at {self.store.root} lacks {sorted(missing)[:3]}; re-convert the checkpoint with this "
                "transformers version."
            )
        slots.fill({n: t.to(self.device) for n, t in params.items() if n in slots.names})
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)

    # -- the split ---------------------------------------------------------------------------

    def _localize_attention(self, roles: dict[str, str], heads: Heads) -> None:
        """Attention modules see their rank's head counts (code that reads them from the config too)."""
        for name in roles:
            parent, _, leaf = name.rpartition(".")
            if leaf not in ("q_proj", FUSED_QKV):
                continue
            attention = self.model.get_submodule(parent)
            attention.config = copy.copy(attention.config)
            attention.config.num_attention_heads = heads.q_count
            attention.config.num_key_value_heads = heads.kv_count
            attention.num_key_value_groups = heads.q_count // heads.kv_count
            for attribute, value in (("num_key_value_heads", heads.kv_count), ("num_heads", heads.q_count)):
                if hasattr(attention, attribute):
                    setattr(attention, attribute, value)

    def _add_collectives(self, roles: dict[str, str]) -> list:
        hooks = []
        for name, role in roles.items():
            module = self.model.get_submodule(name)
            if role == "row":
                hooks.append(module.register_forward_hook(_all_reduce))
            elif role == "head":
                hooks.append(module.register_forward_hook(_gather_vocabulary(self.size)))
            elif role == "vocab":
                module.padding_idx = None   # only gradients use it, and it may lie outside this rank's rows
                rows = module.weight.shape[0]
                pre, post = _vocabulary_lookup(self.rank * rows, (self.rank + 1) * rows)
                hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return hooks

    # -- the transformers surface ------------------------------------------------------------

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    def __call__(self, input_ids: torch.Tensor | None = None, **kwargs):
        """One forward pass on every rank; rank 0's `input_ids` (and attention mask) are used."""
        input_ids, kwargs = self._from_rank_0(input_ids, kwargs)
        check_context(self.model.config, input_ids.shape[-1], 0)
        with torch.no_grad():
            return self.model(input_ids=input_ids, **kwargs)

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """transformers' `generate` on every rank; rank 0's inputs and random state (sampling) are used."""
        input_ids, kwargs = self._from_rank_0(input_ids, kwargs, random_state=True)
        check_context(self.model.config, input_ids.shape[-1],
                      kwargs.get("max_new_tokens") or self.model.generation_config.max_new_tokens or 0)
        return self.model.generate(input_ids=input_ids, **kwargs)

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
        """Drop the hooks; leave the process group (if this model started it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        leave_group()

    def __enter__(self) -> TensorParallelModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def open_tensor_parallel(open_store: Callable[[], Store], device: str | torch.device,
                         compute_dtype: str | torch.dtype | None) -> TensorParallelModel:
    """Join the group, open (or convert) the store once per machine, then build this rank's model."""
    join_group(device)
    return TensorParallelModel(each_machine_once(open_store), device=device, compute_dtype=compute_dtype)
