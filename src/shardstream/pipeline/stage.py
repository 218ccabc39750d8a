"""One pipeline stage: blocks [first, last) of transformers' own model, with their own KV caches.

The stage is the streaming engine (stream/model.py) over its range of blocks: transformers' model built on
`meta` with only the stage's blocks (`num_hidden_layers = last - first`, `layer_types` sliced), so its
DynamicCache, positions and masks count exactly this stage's layers, filled as the whole model's stream is:
the compute dtype, products from 4-bit codes or stored half-precision bytes, pieces read ahead, the first
blocks that fit its budget resident, an embedding read by rows and a big head streamed in slices, experts
read on demand when the stage's are placed on tiers. A plan that gives a stage more blocks than its memory holds passes a
`stream_budget`; without one every block stays in memory.
A later stage receives hidden states: they go in as `inputs_embeds` and a pre-hook on the first
block puts them back unchanged (some families scale embeddings inside `forward`); an earlier stage
stops right after its last block, before the final norm, which it does not hold.
Single-token steps of several sessions can run as one pass (`forward_batch`): each weight read
then serves every session waiting at the stage. Their caches are left-padded into one batch cache,
masked where padded, and split back after the pass; each row keeps its own positions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import InvalidOption
from ..store import Store
from ..store.sharding import load_index
from ..stream.engine_options import EngineOptions
from ..stream.model import StreamingModel
from ..stream.residency import auto_budget

MAX_SESSIONS = 8


class _Stop(Exception):
    """Raised by the last block's hook on a stage without the head: the forward pass ends there."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


class StageModel:
    """Runs `forward(session, position, ids_or_hidden)`; the first stage takes token ids, the last
    returns the next-token logits, any other returns hidden states."""

    def __init__(self, store: Store, first: int, last: int, stream_budget: int | None = None,
                 options: EngineOptions | None = None):
        """`options`: the engine's (the agent's); its resident budget is the plan's: none (every block in
        memory) without `stream_budget`, else that budget, capped by what this process may use now ('auto')."""
        options = options or EngineOptions()
        budget = None if stream_budget is None else min(stream_budget, auto_budget(0))
        placed = any(first <= record.group < last for record in load_index(store).experts.values())
        options = replace(options, max_resident_memory=budget, experts="on_demand" if placed else options.experts)
        self.engine = StreamingModel(store, options, blocks=range(first, last))
        self.first, self.last = first, last
        self.is_first, self.is_last = first == 0, last == store.num_layers
        self.model = self.engine.model
        self.experts = self.engine.experts
        blocks = self.engine.block_modules
        self._closed = False
        self._caches: OrderedDict[str, DynamicCache] = OrderedDict()
        self._lock = threading.Lock()
        self._incoming: torch.Tensor | None = None
        blocks[0].register_forward_pre_hook(self._inject, with_kwargs=True)
        if not self.is_last:
            blocks[-1].register_forward_hook(self._stop)
        # padding plain caches is exact; sliding-window layers and on-demand experts run one session at a time
        layers = DynamicCache(config=self.model.config).layers
        self.batches = self.experts is None and all(type(layer) is DynamicLayer for layer in layers)

    @property
    def streamed_blocks(self) -> list[int]:
        """The blocks (global indices) read from disk on every pass; empty for a stage in memory."""
        resident = set(self.engine.resident_blocks)
        return [self.first + k for k in range(self.last - self.first) if k not in resident]

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
            logits = self.engine(**kwargs, logits_to_keep=0 if all_logits else 1).logits
        except _Stop as stop:
            return stop.hidden
        finally:
            self._incoming = None
        return logits if all_logits else logits[:, -1, :]

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
        """Stop the stage's block reader (after the pass in progress); later passes are refused."""
        with self._lock:
            self._closed = True
            self.engine.close()
