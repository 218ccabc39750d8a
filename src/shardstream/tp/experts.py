"""Expert parallelism for MoE blocks: each rank holds num_experts / N whole experts.

The router (and a shared expert) is replicated, so every rank computes the same routing. A forward
pre-hook on each fused experts module renumbers the router's picks to this rank's experts and sends
every other pick to transformers' sentinel expert (index == the module's `num_experts`, which its
eager, batched and grouped forwards all skip) with a zero weight; a forward hook all-reduces the
experts' output, so every token gets the weighted sum of its top-k experts from whichever ranks hold
them. This is how transformers' own expert parallelism (`ep_dispatch_experts`) runs the experts.

Whole experts rather than a slice of each: a rank's store (rankstore.py) holds each of its experts as
whole tensors (read from whole files, where `shardstream shard --experts` placed them on tiers) and
never touches the other experts' bytes; the collective is the same one all-reduce per MoE block that sliced experts need.
The cost is balance: a decoded token's top-k experts may all be on one rank. With experts='on_demand' the
experts module's forward is the streaming engine's (stream/experts.py), given this rank's experts as the
ones it serves: the same renumbered picks, read from the store's expert files when routed to.
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

EP_STYLE = "ep_dispatch_experts"


class RankExperts:
    """This rank's experts of every MoE block: which stored tensors they are, reading them, the hooks."""

    def __init__(self, model: nn.Module, mapper: WeightMapper, store: Store, rank: int, size: int):
        self.store = store
        self.modules = _experts_modules(model)
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

    def take(self, key: str) -> Take | None:
        """This rank's share of stored expert tensor `key` (one of `stored`): a per-expert tensor whole when
        the expert is this rank's (else None), a fused 3-D one by rows (experts)."""
        expert = self.store.manifest.tensors[key].expert
        if expert is None:
            return Take(0, ((self.first, self.first + self.count),))
        return WHOLE if self._mine(expert) else None

    def placed(self, layer: int) -> list[Expert]:
        """This rank's experts of block `layer` that `shardstream shard --experts` placed on tiers."""
        if not self.modules or not self.store.manifest.sharding:
            return []
        index = load_index(self.store)
        return [Expert(self.store, index, r) for r in index.experts.values() if r.group == layer and self._mine(r.expert)]

    def localize(self) -> list:
        """Each experts module (on `meta`, before it is filled) holds this rank's experts and runs them on the
        router's picks of them; returns the hooks."""
        hooks = []
        for module in self.modules.values():
            for name, parameter in module.named_parameters(recurse=False):
                if parameter.shape and parameter.shape[0] == module.num_experts:   # [experts, ...]
                    module._parameters[name] = nn.Parameter(
                        torch.empty((self.count, *parameter.shape[1:]), dtype=parameter.dtype, device="meta"),
                        requires_grad=False)
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
