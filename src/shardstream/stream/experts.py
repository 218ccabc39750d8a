"""MoE experts loaded on demand: only the experts the router picks are read, from their tiers.

A Mixtral-style block is mostly experts, and a token uses `top_k` of them. With
`experts="on_demand"` the block's part is read without its experts (stored apart by
`shardstream shard --experts`). The fused experts module's forward is wrapped: it sees the router's
`top_k_index`, reads each picked expert with `load_expert` (from whatever tier
`place_experts`/`relocate` put it on, checksum-verified) into a stack of the picked experts only,
and runs transformers' own forward over that stack, the picks renumbered. The memory an expert
takes is spent only for the experts picked, and at most `budget` bytes of them at once: a pass that
picks more (a long prompt picks them all) runs them in groups, each group read and dropped in turn,
so a Mixtral-8x7B block (2.8 GB of experts in bf16) runs in the memory of one of its experts
(0.35 GB). Experts held after a pass serve the next one while their block stays in memory.
"""

from __future__ import annotations

import functools
import mmap
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ..errors import InvalidOption, UnsupportedModel
from ..naming import Part
from ..store import Store
from ..store.sharding import load_expert, load_index
from .direct import BufferPool
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
    """One block's fused experts module, and the experts of it in memory now: `stack` holds the module's
    parameters stacked over the experts `held` lists, in that order, and nothing else."""

    def __init__(self, module: nn.Module, prefix: str):
        self.module = module
        self.meta = dict(module.named_parameters(recurse=False))
        self.names = {f"{prefix}.{name}": name for name in self.meta}
        self.count = next(iter(self.meta.values())).shape[0]
        self.expert_bytes = sum(p.nbytes for p in self.meta.values()) // self.count
        self.held: list[int] = []
        self.stack: dict[str, torch.Tensor] = {}

    def drop(self) -> None:
        """Forget the experts held: the module's slots go back to meta, so nothing keeps their memory."""
        self.module._parameters.update(self.meta)
        self.held, self.stack = [], {}


class OnDemandExperts:
    """Runs each MoE block's experts module on only the experts routed to in this pass, read on demand.

    `budget` bounds the bytes of experts in memory at once (all blocks together): when a pass routes to
    more than fit, they run in groups that do, one group read and dropped after another. `loads` counts
    expert files read, so callers can see how much routing saved.
    """

    def __init__(self, store: Store, model: nn.Module, mapper: WeightMapper, device: torch.device,
                 layers: range | None = None):
        """`layers`: the blocks whose experts to serve (a pipeline stage's), default all."""
        self.store = store
        self._mapper = mapper
        self._device = device
        self.loads = 0
        self.budget = sys.maxsize   # bytes of experts held at once (fit)
        self.read_ahead = True   # the next expert's file read while one is converted (fit)
        self.drop_pages = False   # set when the experts do not all fit in memory
        self._buffers = BufferPool()   # expert files are read into these: one being converted, one read ahead
        index = load_index(store)
        placed = index.experts
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
        self._file_bytes = max(index.files[r.file].size for r in placed.values() if r.group in by_layer)
        self._layers: dict[int, _Layer] = {}
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
            module.forward = functools.partial(self._forward, layer, module.forward)

    @property
    def count(self) -> int:
        """Experts served, over all blocks."""
        return sum(state.count for state in self._layers.values())

    def reading_bytes(self, ahead: bool) -> int:
        """Memory the reading takes beside the experts held: the file being converted (and the next one, read
        `ahead`), and what transformers' conversion allocates (a Mixtral expert's w1 and w3 stacked, then
        joined: up to twice the expert)."""
        return (2 if ahead else 1) * self._file_bytes + 2 * self.expert_bytes

    def fit(self, memory: int, auto: bool) -> None:
        """Size the budget of experts held: `memory` bytes of them (not `auto`), reading ahead; or, `auto`,
        out of `memory` left for the experts and their reading, reading ahead only where that leaves room
        for one expert."""
        if not auto:
            self.budget, self.read_ahead = memory, True
            return
        self.read_ahead = memory >= self.reading_bytes(ahead=True) + self.expert_bytes
        self.budget = max(0, memory - self.reading_bytes(self.read_ahead))

    @property
    def expert_bytes(self) -> int:
        """Bytes of the largest single expert: the least a pass needs at once."""
        return max(state.expert_bytes for state in self._layers.values())

    def _forward(self, layer: int, forward: Callable, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """The module's own forward over the experts held: once when the picked experts fit the budget
        (beside those held from earlier passes, when they fit too), else in as many groups as it needs."""
        state = self._layers[layer]
        routed = sorted(e for e in top_k_index.unique().tolist() if e < state.count)   # count: "no expert"
        if not routed:
            return torch.zeros_like(hidden_states)
        if not set(routed) <= set(state.held):
            union = sorted(set(routed) | set(state.held))
            if (len(state.held) + len(union)) * state.expert_bytes <= self.budget:   # the old stack is copied
                self._hold(layer, union)
        if set(routed) <= set(state.held):
            return self._run(state, forward, hidden_states, top_k_index, top_k_weights)
        size = max(1, min(len(routed), self.budget // state.expert_bytes))
        state.drop()
        reads = self._read(layer, routed)   # one reader over the groups: the next group's first file is read
        out = None                          # while this group computes
        for start in range(0, len(routed), size):
            self._hold(layer, routed[start:start + size], reads)
            part = self._run(state, forward, hidden_states, top_k_index, top_k_weights)
            # a token's two experts in two groups come as x + 0 and 0 + y, added here instead of in one call
            out = part if out is None else out + part
        return out

    def _hold(self, layer: int, experts: list[int], reads: Iterator[dict[str, torch.Tensor]] | None = None) -> None:
        """Put `experts` of `layer` in a stack of their own: those held already are copied over, the others
        read (or taken from `reads`, which yields them in order); other blocks' experts are dropped as far
        as the budget needs."""
        state = self._layers[layer]
        old, rows = state.stack, {expert: row for row, expert in enumerate(state.held)}
        if not rows.keys() & set(experts):
            state.drop()
            old = {}
        need = len(experts) * state.expert_bytes
        for other in self._layers.values():
            if sum(len(s.held) * s.expert_bytes for s in self._layers.values()) + need <= self.budget:
                break
            if other is not state:
                other.drop()
        missing = [e for e in experts if e not in rows or not old]
        converted = reads if reads is not None else self._read(layer, missing) if missing else iter(())
        if len(experts) == 1 and missing:   # transformers' conversion already made it a stack of one
            stack = {state.names[name]: tensor.to(self._device) for name, tensor in next(converted).items()}
        else:
            stack = {name: torch.empty((len(experts), *meta.shape[1:]), dtype=meta.dtype, device=self._device)
                     for name, meta in state.meta.items()}
            for row, expert in enumerate(experts):
                if expert in rows and old:
                    for name, tensor in old.items():
                        stack[name][row].copy_(tensor[rows[expert]])
                    continue
                for name, tensor in next(converted).items():
                    stack[state.names[name]][row].copy_(tensor[0])
        state.drop()
        state.held, state.stack = experts, stack
        for name, tensor in stack.items():
            state.module._parameters[name] = nn.Parameter(tensor, requires_grad=False)

    def _read(self, layer: int, experts: list[int]) -> Iterator[dict[str, torch.Tensor]]:
        """Each expert's tensors in transformers' layout, in turn; with `read_ahead` the next expert's file is
        read and checked on a thread while this one is converted, copied and (the last of a group) run."""
        with ThreadPoolExecutor(1, thread_name_prefix="experts") as reader:
            ahead = reader.submit(self._load, layer, experts[0])
            for i in range(len(experts)):
                tensors, buffer = ahead.result()
                if self.read_ahead and i + 1 < len(experts):
                    ahead = reader.submit(self._load, layer, experts[i + 1])
                self.loads += 1
                try:
                    converted = self._mapper.convert(tensors)
                    if buffer is not None:   # the buffer is read into again: nothing may still view it
                        start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
                        converted = {name: t.clone() if start <= t.data_ptr() < start + len(buffer) else t
                                     for name, t in converted.items()}
                finally:
                    del tensors
                    if buffer is not None:
                        self._buffers.give([buffer])
                yield converted
                if not self.read_ahead and i + 1 < len(experts):
                    ahead = reader.submit(self._load, layer, experts[i + 1])

    def _load(self, layer: int, expert: int) -> tuple[dict[str, torch.Tensor], mmap.mmap | None]:
        """One expert's checkpoint tensors, read and checked: into a reused buffer (then given back by the
        caller) from a local file, past the page cache when `drop_pages` (Expert.read_into)."""
        placed = load_expert(self.store, layer, expert)
        if placed.path is None:
            return placed.tensors, None
        buffer = self._buffers.take(self._file_bytes)
        try:
            return placed.read_into(buffer, drop=self.drop_pages), buffer
        except BaseException:
            self._buffers.give([buffer])
            raise

    def _run(self, state: _Layer, forward: Callable, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' forward of the experts module with the experts held as the whole set: routes to
        others become its "no expert" index with a zero weight."""
        held = len(state.held)
        rows = torch.full((state.count + 1,), held, dtype=top_k_index.dtype, device=top_k_index.device)
        rows[torch.tensor(state.held, dtype=torch.long, device=rows.device)] = torch.arange(held, dtype=rows.dtype, device=rows.device)
        index = rows[top_k_index]
        outside = index == held
        others = bool(outside.any())
        weights = top_k_weights.masked_fill(outside, 0) if others else top_k_weights
        module = state.module
        module.num_experts, module._is_expert_parallel = held, others   # the latter masks the "no expert" rows
        try:
            return forward(hidden_states, index, weights)
        finally:
            module.num_experts, module._is_expert_parallel = state.count, False

    def release(self, layer: int) -> None:
        """The block was emptied: drop its experts too."""
        state = self._layers.get(layer)
        if state is not None:
            state.drop()
