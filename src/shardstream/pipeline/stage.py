"""One pipeline stage: blocks [first, last) of transformers' own model, with their own KV caches.

The stage model is built on `meta` from the store's config with only this stage's blocks
(`num_hidden_layers = last - first`, `layer_types` sliced), so its DynamicCache, positions and masks
count exactly this stage's layers. Weights are mapped with the streaming runtime's `WeightMapper`
on a full meta model (checkpoint names keep the global block index) and renumbered into place.
A later stage receives hidden states: they go in as `inputs_embeds` and a pre-hook on the first
block puts them back unchanged (some families scale embeddings inside `forward`); an earlier stage
stops right after its last block, before the final norm, which it does not hold.
When the stage's experts are placed on tiers, its blocks load without them and the streaming
runtime's `OnDemandExperts` reads only the experts the router picks (from the stage's own tiers).
With a `stream_budget` (the plan gave this device more blocks than its memory holds) the blocks are
streamed from the stage's files instead (see streamed.py): the same forward, hooks and caches.
Single-token steps of several sessions can run as one pass (`forward_batch`): each weight read
then serves every session waiting at the stage. Their caches are left-padded into one batch cache,
masked where padded, and split back after the pass; each row keeps its own positions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from ..errors import InvalidOption, UnsupportedModel
from ..store.sharding import load_index
from ..store import Store
from ..stream.blocks import StreamedBlocks
from ..stream.experts import ExpertlessLoader, OnDemandExperts
from ..stream.loader import BlockLoader, LoadedBlock
from ..stream.meta import build_meta_model, common_module, config_dtype
from ..stream.pieces import whole
from ..stream.residency import resolve_budget
from ..stream.weights import Slots, WeightMapper, parameters_on_meta
from .streamed import stream_blocks

MAX_SESSIONS = 8


class _Stop(Exception):
    """Raised by the last block's hook on a stage without the head: the forward pass ends there."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


class StageModel:
    """Runs `forward(session, position, ids_or_hidden)`; the first stage takes token ids, the last
    returns the next-token logits, any other returns hidden states."""

    def __init__(self, store: Store, first: int, last: int, stream_budget: int | None = None):
        n = store.num_layers
        if not 0 <= first < last <= n:
            raise InvalidOption(f"stage blocks [{first}, {last}) are outside the model's {n} blocks; re-plan.")
        self.first, self.last = first, last
        self.is_first, self.is_last = first == 0, last == n
        full = build_meta_model(store, None)
        mapper = WeightMapper(full)
        global_prefixes = [common_module(mapper.target_names(store.tensor_names(f"mid/{i}"))) for i in range(first, last)]
        self.model = _stage_meta_model(store, first, last)
        prefixes = [_renumbered(p, k) for k, p in enumerate(global_prefixes)]
        renamed = _GlobalNames(self.model, dict(zip(global_prefixes, prefixes)))
        self.experts = _on_demand_experts(store, first, last, renamed, mapper)
        self._renames = list(zip(global_prefixes, prefixes))
        self._blocks = [self.model.get_submodule(p) for p in prefixes]
        self.streaming: StreamedBlocks | None = None
        if stream_budget is None:
            skip = self.experts.checkpoint_names if self.experts else set()
            for index in range(last - first):
                tensors = store.load(f"mid/{first + index}", verify=True, experts=self.experts is None)
                params = mapper.convert({name: tensor for name, tensor in tensors.items() if name not in skip})
                Slots(self._blocks[index], prefixes[index]).fill(self._renamed(index, params))
            self._fill_outside(store, mapper, prefixes)
        else:
            outside = self._fill_outside(store, mapper, prefixes)
            self.streaming = self._stream(store, mapper, prefixes, min(stream_budget, resolve_budget("auto", outside)))
        self._closed = False
        self._caches: OrderedDict[str, DynamicCache] = OrderedDict()
        self._lock = threading.Lock()
        self._incoming: torch.Tensor | None = None
        self._blocks[0].register_forward_pre_hook(self._inject, with_kwargs=True)
        if not self.is_last:
            self._blocks[-1].register_forward_hook(self._stop)
        # padding plain caches is exact; sliding-window layers and on-demand experts run one session at a time
        layers = DynamicCache(config=self.model.config).layers
        self.batches = self.experts is None and all(type(layer) is DynamicLayer for layer in layers)

    def _renamed(self, index: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Block `index`'s parameters from the full model's names to the stage's."""
        old, new = self._renames[index]
        return {new + name[len(old):]: tensor for name, tensor in params.items()}

    def _stream(self, store: Store, mapper: WeightMapper, prefixes: list[str], budget: int) -> StreamedBlocks:
        """The stream runtime's loader over the stage's files (O_DIRECT when they exceed memory); the
        budget is the plan's, capped by what this process may use now (resolve_budget's 'auto')."""
        cpu = torch.device("cpu")
        loader = (ExpertlessLoader(store, mapper, cpu, True, self.experts.checkpoint_names) if self.experts
                  else BlockLoader(store, mapper, cpu, True))

        # each block is one piece, read into the loader's reused buffers (a quantized one dequantized into them)
        plan = {}
        for index, block in enumerate(self._blocks):
            keys = loader.checkpoint_keys(self.first + index)
            split = loader.split(self.first + index, whole(block, mapper.target_names(keys), 0))
            plan[(self.first + index, 0)] = split[0] if split is not None else None
        loader.plan(plan, frozenset())

        def renamed(index: int, block: LoadedBlock) -> LoadedBlock:
            block.params = self._renamed(index, block.params)
            return block

        slots = [Slots(block, prefix) for block, prefix in zip(self._blocks, prefixes)]
        return stream_blocks(self._blocks, slots, lambda index: renamed(index, loader.load(self.first + index)),
                             lambda index: renamed(index, loader.load_piece((self.first + index, 0))), budget)

    @property
    def streamed_blocks(self) -> list[int]:
        """The blocks (global indices) read from disk on every pass; empty for a stage in memory."""
        return [self.first + k for k in self.streaming.streamed] if self.streaming else []

    def _fill_outside(self, store: Store, mapper: WeightMapper, prefixes: list[str]) -> int:
        """Embeddings on the first stage, final norm and head on the last; the rest stays on meta.
        Returns the bytes filled."""
        parts = (["start"] if self.is_first else []) + (["end"] if self.is_last else [])
        tensors: dict[str, torch.Tensor] = {}
        for part in parts:
            tensors.update(store.load(part, verify=True))
        params = mapper.convert(tensors)
        for tied, source in getattr(self.model, "all_tied_weights_keys", {}).items():
            if tied not in params and source in params:
                params[tied] = params[source]
        outside = Slots(self.model, exclude=tuple(prefixes))
        outside.fill({name: tensor for name, tensor in params.items() if name in outside.names})
        if not self.is_first:
            embeddings = _module_name(self.model, self.model.get_input_embeddings()) + "."
            other = [n for n in mapper.target_names(store.tensor_names("start")) if not n.startswith(embeddings)]
            if other:
                raise UnsupportedModel(
                    f"{type(self.model).__name__} uses {sorted(other)[:3]} before its blocks besides the token "
                    "embeddings, so only a single stage can run it; plan it on one device.")
        return outside.nbytes

    # -- hooks -------------------------------------------------------------------------------

    def _inject(self, module, args, kwargs):
        if self._incoming is None:
            return None
        hidden, self._incoming = self._incoming, None
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _stop(self, module, args, output):
        raise _Stop(output[0] if isinstance(output, tuple) else output)

    # -- inference ---------------------------------------------------------------------------

    def forward(self, session: str, position: int, data: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Ids [1, s] (first stage) or hidden states [1, s, h] at `position` -> hidden [1, s, h] or
        logits [1, vocab] of the last position (last stage; with `all_logits`, [1, s, vocab] of every
        position, for a prompt's scores)."""
        with self._lock, torch.no_grad():
            self._check_open()
            return self._run(data, all_logits=all_logits, past_key_values=self._cache(session, position))

    def forward_batch(self, steps: list[tuple[str, int, torch.Tensor]]) -> list[torch.Tensor]:
        """`forward` for one new token of each of several sessions (distinct, each past its prompt),
        in one pass; the outputs in the order of `steps`. Nothing changes when it raises."""
        if not self.batches:
            raise InvalidOption(f"blocks {self.first}-{self.last - 1} run one session at a time")
        if len({session for session, _, _ in steps}) != len(steps) or any(
                position < 1 or data.shape[1] != 1 for _, position, data in steps):
            raise InvalidOption("a batched step takes one new token of each of distinct, started sessions")
        with self._lock, torch.no_grad():
            self._check_open()
            caches = [self._cache(session, position) for session, position, _ in steps]
            lengths = [position for _, position, _ in steps]
            longest = max(lengths)
            batch = DynamicCache(config=self.model.config)
            for index in range(len(batch.layers)):
                batch.update(*(torch.cat([F.pad(getattr(cache.layers[index], part), (0, 0, longest - length, 0))
                                          for cache, length in zip(caches, lengths)])
                               for part in ("keys", "values")), index)
            mask = torch.tensor([[0] * (longest - length) + [1] * (length + 1) for length in lengths])
            output = self._run(torch.cat([data for _, _, data in steps]), past_key_values=batch, attention_mask=mask,
                               position_ids=torch.tensor(lengths).unsqueeze(1))
            for row, (cache, length) in enumerate(zip(caches, lengths)):
                for mine, theirs in zip(cache.layers, batch.layers):
                    mine.keys = theirs.keys[row:row + 1, :, longest - length:]
                    mine.values = theirs.values[row:row + 1, :, longest - length:]
            return list(output.split(1))

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidOption(f"blocks {self.first}-{self.last - 1} were unloaded; re-send on the current plan.")

    def _run(self, data: torch.Tensor, all_logits: bool = False, **kwargs) -> torch.Tensor:
        """One pass of the stage over ids or hidden states `data` with the given cache (and mask)."""
        kwargs["use_cache"] = True
        if self.is_first:
            kwargs["input_ids"] = data
        else:
            self._incoming = data = data.to(self.model.dtype)
            kwargs["inputs_embeds"] = data
        try:
            if self.is_last:
                logits = self.model(**kwargs, logits_to_keep=0 if all_logits else 1).logits
                return logits if all_logits else logits[:, -1, :]
            self.model.get_submodule(self.model.base_model_prefix)(**kwargs)
        except _Stop as stop:
            return stop.hidden
        finally:
            self._incoming = None
            if self.streaming:
                self.streaming.release()
        raise AssertionError("a stage without the head must stop after its last block")

    def _cache(self, session: str, position: int) -> DynamicCache:
        """This session's cache, which must hold exactly `position` tokens (position 0 starts anew)."""
        if position == 0:
            self._caches.pop(session, None)
            self._caches[session] = DynamicCache(config=self.model.config)
            while len(self._caches) > MAX_SESSIONS:
                self._caches.popitem(last=False)
        cache = self._caches.get(session)
        held = cache.get_seq_length() if cache is not None else None
        if held != position:
            raise InvalidOption(
                f"session {session!r} is at token {held} on blocks {self.first}-{self.last - 1}, not {position}; "
                "replay the request from its first token.")
        self._caches.move_to_end(session)
        return cache

    def end(self, session: str) -> None:
        with self._lock:
            self._caches.pop(session, None)

    def close(self) -> None:
        """Stop a streamed stage's reader (after the pass in progress); later passes are refused."""
        with self._lock:
            self._closed = True
            if self.streaming:
                self.streaming.close()


class _GlobalNames:
    """The stage model under the full model's module names (global block index), as
    `OnDemandExperts` names the modules it hooks."""

    def __init__(self, model: nn.Module, renamed: dict[str, str]):
        self._model, self._renamed = model, renamed

    def get_submodule(self, name: str) -> nn.Module:
        block = next(old for old in self._renamed if name == old or name.startswith(old + "."))
        return self._model.get_submodule(self._renamed[block] + name[len(block):])


def _on_demand_experts(store: Store, first: int, last: int, model: _GlobalNames,
                       mapper: WeightMapper) -> OnDemandExperts | None:
    """On-demand experts for blocks [first, last) when theirs are placed on tiers, else None."""
    if not any(first <= record.group < last for record in load_index(store).experts.values()):
        return None
    return OnDemandExperts(store, model, mapper, torch.device("cpu"), layers=range(first, last))


def _stage_meta_model(store: Store, first: int, last: int) -> PreTrainedModel:
    """transformers' model class on meta with only blocks [first, last), renumbered from 0."""
    config = AutoConfig.from_pretrained(store.root)
    config.num_hidden_layers = last - first
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[first:last])
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=config_dtype(config))
    return model.eval()


def _renumbered(prefix: str, index: int) -> str:
    """'model.layers.7' -> 'model.layers.<index>': blocks sit in a ModuleList."""
    container, _, number = prefix.rpartition(".")
    if not number.isdigit():
        raise UnsupportedModel(f"block module {prefix!r} is not an item of a module list; this family cannot be staged.")
    return f"{container}.{index}"


def _module_name(root: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is module)
