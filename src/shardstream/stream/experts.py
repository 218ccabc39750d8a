"""MoE experts loaded on demand: only the experts the router picks are read, from their tiers.

A Mixtral-style block is mostly experts, and a token uses `top_k` of them. With
`experts="on_demand"` the block's part is read without its experts (stored apart by
`shardstream shard --experts`); a forward pre-hook on
the fused experts module sees the router's `top_k_index`, reads each newly picked expert with
`load_expert` (from whatever tier `place_experts`/`relocate` put it on, checksum-verified) and
writes it into its row of the fused parameters. Rows of experts nobody picked stay zero and are
never read by the module. What was loaded lives as long as the block's other weights.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..errors import InvalidOption, UnsupportedModel
from ..naming import Part
from ..store import Store
from ..store.sharding import load_expert, load_index
from .loader import BlockLoader
from .weights import Slots, WeightMapper

EXPERT_MODES = ("with_block", "on_demand")


class ExpertlessLoader(BlockLoader):
    """A BlockLoader whose parts come without the expert tensors (those are loaded on demand).

    Experts still inside a part (a `shard --experts` run that was killed before it rewrote the
    part) are dropped after the read."""

    def __init__(self, store: Store, mapper: WeightMapper, device: torch.device, verify: bool, skip: set[str]):
        super().__init__(store, mapper, device, verify, experts=False)
        self._skip = skip

    def read(self, parts: list[str], resident: bool = False, keep: frozenset[str] | None = None,
             tied: bool = True, mappings: list | None = None) -> dict[str, torch.Tensor]:
        return {n: t for n, t in super().read(parts, resident, keep, tied, mappings).items() if n not in self._skip}

    def checkpoint_keys(self, index: int) -> list[str]:
        return [n for n in super().checkpoint_keys(index) if n not in self._skip]


class _Layer:
    """One block's fused experts module, and which of its experts are in place right now."""

    def __init__(self, module: nn.Module, prefix: str):
        self.slots = Slots(module, prefix)
        self.meta = {f"{prefix}.{name}": p for name, p in module.named_parameters(recurse=False)}
        self.count = next(iter(self.meta.values())).shape[0]
        self.fused: dict[str, torch.Tensor] = {}
        self.loaded: set[int] = set()


class OnDemandExperts:
    """Fills each MoE block's fused expert parameters with only the experts routed to in this pass.

    `loads` counts expert files read, so callers can see how much routing saved.
    """

    def __init__(self, store: Store, model: nn.Module, mapper: WeightMapper, device: torch.device,
                 layers: range | None = None):
        """`layers`: the blocks whose experts to serve (a pipeline stage's), default all."""
        self.store = store
        self._mapper = mapper
        self._device = device
        self.loads = 0
        placed = load_index(store).experts
        by_layer: dict[int, set[str]] = {}
        for record in placed.values():
            by_layer.setdefault(record.group, set()).update(record.tensors)
        for record in store.manifest.tensors.values():
            if record.expert is None:
                continue
            layer = Part.parse(record.part).index
            if (layers is None or layer in layers) and f"{layer}:{record.expert}" not in placed:
                raise InvalidOption(
                    f"experts='on_demand' needs every expert placed on a tier, but {store.root} has no placed "
                    f"expert {layer}:{record.expert}; run `shardstream shard {store.root} --experts` first."
                )
        if layers is not None:
            by_layer = {layer: names for layer, names in by_layer.items() if layer in layers}
        if not by_layer:
            raise InvalidOption(f"experts='on_demand' needs a mixture-of-experts model; the store at {store.root} has none.")
        self.checkpoint_names = set().union(*by_layer.values())
        self._layers: dict[int, _Layer] = {}
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []
        for layer, names in by_layer.items():
            modules = {target.rpartition(".")[0] for target in mapper.target_names(sorted(names))}
            if len(modules) != 1:
                raise UnsupportedModel(
                    f"the experts of part mid/{layer} in {store.root} map onto {sorted(modules)}, not one fused "
                    f"experts module of {type(model).__name__}; use experts='with_block'."
                )
            prefix = modules.pop()
            module = model.get_submodule(prefix)
            self._layers[layer] = _Layer(module, prefix)
            self.hooks.append(module.register_forward_pre_hook(functools.partial(self._before, layer), with_kwargs=True))

    @property
    def layer_bytes(self) -> int:
        """Bytes of the largest block's fused expert parameters, all filled when a pass routes to every expert."""
        return max(sum(p.nbytes for p in state.meta.values()) for state in self._layers.values())

    def _before(self, layer: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        state = self._layers[layer]
        top_k_index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
        if not state.fused:
            state.fused = {name: torch.zeros(meta.shape, dtype=meta.dtype, device=self._device)
                           for name, meta in state.meta.items()}
        for expert in sorted(set(top_k_index.unique().tolist()) - state.loaded):
            if expert >= state.count:  # transformers' "no expert" padding index
                continue
            converted = self._mapper.convert(load_expert(self.store, layer, expert).tensors)
            self.loads += 1
            for name, tensor in converted.items():
                state.fused[name][expert].copy_(tensor[0])
            state.loaded.add(expert)
        state.slots.fill(state.fused)

    def release(self, layer: int) -> None:
        """The block was emptied: drop its experts too."""
        state = self._layers.get(layer)
        if state is not None:
            state.fused, state.loaded = {}, set()
