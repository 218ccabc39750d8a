"""Expert parallelism for MoE blocks: each rank holds num_experts / N whole experts.

The router (and a shared expert) is replicated, so every rank computes the same routing. A forward
pre-hook on each fused experts module renumbers the router's picks to this rank's experts and sends
every other pick to transformers' sentinel expert (index == the module's `num_experts`, which its
eager, batched and grouped forwards all skip) with a zero weight; a forward hook all-reduces the
experts' output, so every token gets the weighted sum of its top-k experts from whichever ranks hold
them. This is how transformers' own expert parallelism (`ep_dispatch_experts`) runs the experts.

Whole experts rather than a slice of each: a rank reads each of its experts as whole tensors (or
whole files, where `shardstream shard --experts` placed them on tiers) and never touches the other
experts' bytes; the collective is the same one all-reduce per MoE block that sliced experts need.
The cost is balance: a decoded token's top-k experts may all be on one rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..store.reader import Store
from ..store.sharding import Expert, load_index
from ..stream.weights import WeightMapper
from .layout import WHOLE, Take, _share
from .reading import ShareReader

EP_STYLE = "ep_dispatch_experts"


class RankExperts:
    """This rank's experts of every MoE block: which stored tensors they are, reading them, the hooks."""

    def __init__(self, model: nn.Module, mapper: WeightMapper, store: Store, rank: int, size: int):
        self.store = store
        self.modules = _experts_modules(model)
        self.bytes_read = 0
        self.first = self.count = 0
        if self.modules:
            total = next(iter(self.modules.values())).num_experts
            field = "num_local_experts" if hasattr(model.config, "num_local_experts") else "num_experts"
            self.first, stop = _share(total, rank, size, "the experts", field)
            self.count = stop - self.first
        # stored tensor name -> the experts module it fills (experts placed on tiers are not in the manifest)
        self.stored = {key: module for key in store.manifest.tensors
                       for module in {name.rpartition(".")[0] for name in mapper.target_names([key])}
                       if module in self.modules}

    def _mine(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def read(self) -> dict[str, torch.Tensor]:
        """This rank's experts only: per-expert tensors whole, fused 3-D ones by rows (experts), placed
        experts as their tier files (checksum-verified); every byte read is counted."""
        reader = ShareReader(self.store)
        tensors = {}
        for key in self.stored:
            record = self.store.manifest.tensors[key]
            if record.expert is None:
                tensors[key] = reader.read(record, Take(0, ((self.first, self.first + self.count),)))
            elif self._mine(record.expert):
                tensors[key] = reader.read(record, WHOLE)
        self.bytes_read = reader.bytes_read
        if self.modules and self.store.manifest.sharding:
            index = load_index(self.store)
            for placed in index.experts.values():
                if self._mine(placed.expert):
                    tensors.update(Expert(self.store, index, placed).tensors)
                    self.bytes_read += index.files[placed.file].size
        return tensors

    def localize(self) -> list:
        """Each experts module runs this rank's experts on the router's picks of them; returns the hooks."""
        hooks = []
        for module in self.modules.values():
            module.num_experts = self.count
            module._is_expert_parallel = True   # batched/grouped forwards then mask the sentinel's rows
            hooks += [module.register_forward_pre_hook(_local_picks(self.first, self.count), with_kwargs=True),
                      module.register_forward_hook(_summed)]
        return hooks


def _experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fused experts modules the model's own expert-parallel plan names (none for a dense model)."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    prefix = model.base_model_prefix + "."
    patterns = [re.compile(re.escape(prefix + key).replace(r"\*", r"\d+") + "$")
                for key, style in plan.items() if style == EP_STYLE]
    return {name: module for name, module in model.named_modules() if any(p.match(name) for p in patterns)}


ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


def _local_picks(first: int, count: int) -> Callable:
    def renumber(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Picks of experts [first, first + count) -> local ids; the others -> the sentinel, weight 0."""
        values = {**dict(zip(ARGUMENTS, args)), **kwargs}
        index = values["top_k_index"]
        mine = (index >= first) & (index < first + count)
        values["top_k_index"] = torch.where(mine, index - first, count)
        values["top_k_weights"] = values["top_k_weights"].masked_fill(~mine, 0)
        return (), values
    return renumber


def _summed(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """Each rank's experts' share of every token -> the whole MoE output on every rank."""
    dist.all_reduce(output)
    return output
