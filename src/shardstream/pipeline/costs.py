"""What the planner needs, sized from the store's manifest and config without loading a weight.

Memory is counted at the size a stage holds it in (the streaming engine's rule, stream/ends.py and
linear.py): a block's stored bytes (a quantized store's codes, bf16 as stored), a big embedding not at all
(its rows are read by offset), a big head whole or, when the stage streams it, read on every token. A block
whose experts are placed apart (`shardstream shard --experts`) runs with them read on demand
(pipeline/stage.py): it holds its other weights and the buffers its experts are read into (stream/experts.py's
rule, at their stored size), and reads `num_experts_per_tok` experts of its average size a token. Flops per
token are about twice the parameter count. The KV cache holds keys and values per token: 2 x kv heads
x head dim x dtype.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, PretrainedConfig

from ..store import Store
from ..store.direct_io import aligned
from ..store.sharding import placed_in
from ..stream.ends import STREAMED_BYTES, by_rows
from ..stream.experts import reading_bytes
from ..stream.meta import config_dtype
from .planner import Device, LayerCost, ModelCost


def model_cost(store: Store) -> ModelCost:
    """Per-block weight bytes, KV bytes per token and flops per token, plus start and end parts."""
    config = AutoConfig.from_pretrained(store.root)
    size = config_dtype(config).itemsize
    kv = 2 * _num_kv_heads(config) * _head_dim(config) * size
    top_k = getattr(config, "num_experts_per_tok", None)
    return ModelCost(
        layers=[_layer(store, i, kv, top_k) for i in range(store.num_layers)],
        activation_bytes_per_token=config.hidden_size * size,
        start_bytes=_stored(store, "start") - _streamable(store, "start"),
        end_bytes=_stored(store, "end"),
        end_flops_per_token=2.0 * _params(store, "end"),
        head_bytes=_streamable(store, "end"),
    )


def _layer(store: Store, index: int, kv: int, top_k: int | None) -> LayerCost:
    """Block `index` as its stage runs it: whole in memory, or with its placed experts read on demand (`top_k`
    of them a token; every one where the config names no top k)."""
    part = f"mid/{index}"
    flops = 2.0 * _params(store, part)
    placed = [record.length for record in placed_in(store, index)]
    if not placed:
        return LayerCost(_stored(store, part), kv, flops)
    # experts a `shard --experts` left in the part (killed before rewriting it) are dropped once read
    held = sum(record.stored_bytes for record in _records(store, part) if record.expert is None)
    routed = min(top_k or len(placed), len(placed))
    return LayerCost(held, kv, flops, expert_reading_bytes=reading_bytes(aligned(max(placed)), ahead=True),
                     expert_bytes_per_token=routed * sum(placed) // len(placed))


def activation_bytes(store: Store, context_length: int) -> int:
    """Peak working memory of a prefill of `context_length` tokens: hidden states, the MLP's
    intermediate and one layer's attention scores (float32, all heads)."""
    config = AutoConfig.from_pretrained(store.root)
    size = config_dtype(config).itemsize
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    per_token = (4 * config.hidden_size + 3 * intermediate) * size
    scores = config.num_attention_heads * context_length * context_length * torch.float32.itemsize
    return context_length * per_token + scores


def device_from_profile(name: str, available_bytes: int, gflops: float, mem_fraction: float,
                        activations: int, disk_bytes_per_s: float = 0.0) -> Device:
    """A planner device: its share of the free RAM, less the activations it must keep room for, and
    the disk read speed that prices a streamed stage (0: it may not stream)."""
    return Device(name, int(available_bytes * mem_fraction), gflops, overhead_bytes=activations,
                  disk_bytes_per_s=disk_bytes_per_s)


def _records(store: Store, part: str) -> list:
    """The tensor records a load of `part` reads, tied aliases resolved to their targets (stored elsewhere)."""
    if part not in store.manifest.parts:
        return []
    tensors, aliases = store.manifest.tensors, store.manifest.aliases
    names = store.manifest.parts[part].tensors + [n for n, a in aliases.items() if a["part"] == part]
    return [tensors[aliases.get(name, {}).get("target", name)] for name in names]


def _stored(store: Store, part: str) -> int:
    """Stored bytes of `part`'s tensors (codes and scales of quantized ones), tied aliases counted."""
    return sum(r.stored_bytes for r in _records(store, part))


def _streamable(store: Store, part: str) -> int:
    """Stored bytes of `part`'s big matrices whose rows can be read by offset (ends.by_rows): an embedding read by
    rows, a head that may be streamed."""
    return sum(r.stored_bytes for r in _records(store, part) if by_rows(r) and r.stored_bytes >= STREAMED_BYTES)


def _params(store: Store, part: str) -> int:
    """Parameters a load of `part` yields, tied aliases included (their target's count)."""
    shapes = store.tensor_shapes(part).values() if part in store.manifest.parts else []
    return sum(math.prod(shape) for shape in shapes)


def _num_kv_heads(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
