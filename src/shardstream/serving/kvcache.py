"""The running batch's KV cache, reserved ahead: each layer's keys (and values) of every row live in
one tensor as wide as the batch's widest row plus the most tokens any row may still generate (at most
`batching.KV_AHEAD_TOKENS` of them: past those the engine widens the reservation while memory allows),
and each pass writes its new columns in place.

transformers' DynamicCache grows by `torch.cat`: every decode step copies every layer's whole cache
into a new tensor, a large share of a batch's decode step that grows with its rows, and each copy leaves
a transient copy of a layer behind (docs/BENCHMARKS.md, section "Many tokens per weight read").
StaticCache writes in place but cannot take rows in or out, which continuous batching does between
steps. `ReservedLayer` is a DynamicLayer (so transformers' masks and `get_seq_length` work unchanged)
whose `keys`/`values` are views of the first columns of a reserved tensor; `merge` and `select` rebuild
the reservation when rows join or leave, one layer at a time. A streaming model's `generate` takes one
too (`generation_cache`), reserved for the prompt and the tokens to generate. The bytes reserved are
exactly what the batch engine's admission counts (`admission.kv_peak`), so the memory a batch takes is
the memory it was admitted for.
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer, get_layer_types_and_kwargs


class ReservedLayer(DynamicLayer):
    """One layer's keys and values: views of a tensor reserved `capacity` columns wide; a pass that
    would outgrow it (a caller that reserved too little) gets a wider reservation, never a failure."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._keys: torch.Tensor | None = None     # the reservations: (rows, heads, capacity, head_dim)
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = _reserve(key_states, self.capacity)
        self._values = _reserve(value_states, self.capacity)
        self.keys, self.values = self._keys[..., :0, :], self._values[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            self.keep(list(range(self.keys.shape[0])), self.keys, self.values, end)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def keep(self, rows: list[int], keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Make rows `rows` of `keys`/`values` this layer's contents, in a new reservation `capacity`
        wide; copied row by row, so the layer is never in memory more than twice."""
        width = keys.shape[-2]
        self.capacity = max(capacity, width)
        reserved_keys = _reserve(keys, self.capacity, len(rows))
        reserved_values = _reserve(values, self.capacity, len(rows))
        for new, old in enumerate(rows):
            reserved_keys[new, ..., :width, :] = keys[old]
            reserved_values[new, ..., :width, :] = values[old]
        self._keys, self._values = reserved_keys, reserved_values
        self.keys, self.values = reserved_keys[..., :width, :], reserved_values[..., :width, :]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering of rows, written back into the reservation (DynamicLayer's would
        leave `keys` apart from it, and the next update would write over the reordered rows)."""
        if self.get_seq_length() > 0:
            width = self.keys.shape[-2]
            for reserved in (self._keys, self._values):
                reserved[..., :width, :] = reserved[..., :width, :].index_select(0, beam_idx.to(reserved.device))

    def reset(self) -> None:
        self._keys = self._values = None
        super().reset()

    @property
    def reserved_bytes(self) -> int:
        return 0 if self._keys is None else self._keys.nbytes + self._values.nbytes


def _reserve(like: torch.Tensor, capacity: int, rows: int | None = None) -> torch.Tensor:
    """Zeroed, so the reservation is in memory (counted as used) from the start, and the columns left of
    a left-padded row are zeros: masked out, but a NaN there would still poison the attention sums."""
    return like.new_zeros((like.shape[0] if rows is None else rows, *like.shape[1:-2], capacity, like.shape[-1]))


def reserved_cache(capacity: int) -> DynamicCache:
    """An empty cache whose layers reserve `capacity` columns when the first pass fills them."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(ReservedLayer, capacity)
    return cache


def generation_cache(config, capacity: int) -> DynamicCache | None:
    """A cache for `generate` reserved `capacity` columns wide (prompt plus new tokens), where transformers
    would give every layer a full DynamicLayer; None (transformers' own cache) where a layer keeps less, as a
    sliding window's does."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if any(DYNAMIC_LAYER_TYPE_MAPPING.get(kind) is not DynamicLayer for kind in layer_types):
        return None
    return reserved_cache(capacity)


def filled_layers(cache: DynamicCache) -> list[ReservedLayer]:
    return [layer for layer in cache.layers if layer.keys is not None and layer.keys.numel()]


def reserved_bytes(cache: DynamicCache | None) -> int:
    return sum(layer.reserved_bytes for layer in cache.layers) if cache is not None else 0


def reserved_columns(cache: DynamicCache) -> int:
    """How wide the cache's reservation is: the columns its rows may fill before it must grow."""
    return min(layer.capacity for layer in filled_layers(cache))


def merge(cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor,
          remaining: int) -> torch.Tensor:
    """Append `other`'s rows to `cache` (in place), left-padding the narrower one with zeros, into a
    reservation `remaining` columns wider than both; returns the merged mask. Layer by layer, `other`'s layer dropped at
    once: the peak is the merged cache plus one layer, not the old cache and the merged one side by side."""
    rows, width, other_width = mask.shape[0], mask.shape[1], other_mask.shape[1]
    total = max(width, other_width)
    for mine, theirs in zip(filled_layers(cache), filled_layers(other), strict=True):
        for name in ("_keys", "_values"):
            old, new = getattr(mine, name)[..., :width, :], getattr(theirs, name)[..., :other_width, :]
            merged = _reserve(old, total + remaining, rows + new.shape[0])
            merged[:rows, ..., total - width: total, :] = old
            merged[rows:, ..., total - other_width: total, :] = new
            setattr(mine, name, merged)
            setattr(theirs, name, None)
            del old, new
        mine.capacity = mine._keys.shape[-2]
        mine.keys, mine.values = mine._keys[..., :total, :], mine._values[..., :total, :]
        theirs.keys = theirs.values = None
    return torch.cat([_pad_left(mask, total - width), _pad_left(other_mask, total - other_width)])


def select(cache: DynamicCache, mask: torch.Tensor, rows: list[int], remaining: int) -> torch.Tensor:
    """Keep only `rows` (in place), drop the leading columns that are padding in every kept row, and
    re-reserve `remaining` more columns than the kept ones (the most tokens a kept row may still
    generate), so that finished rows' memory is given back at once; returns the kept mask. Keeping every
    row of a reservation wide enough is free."""
    index = torch.tensor(rows, device=mask.device)
    kept = mask[index]
    leading = int(torch.cumprod((kept.sum(0) == 0).int(), 0).sum()) if rows else 0
    kept = kept[:, leading:]
    layers = filled_layers(cache)
    every = len(rows) == mask.shape[0]
    if every and not leading and all(layer.capacity >= kept.shape[1] + remaining for layer in layers):
        return kept
    for layer in layers:
        layer.keep(rows, layer.keys[:, :, leading:], layer.values[:, :, leading:], kept.shape[1] + remaining)
    return kept


def _pad_left(mask: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros((mask.shape[0], count)), mask], 1) if count else mask
