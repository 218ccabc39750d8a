"""config.json checked against its checkpoint before a store is written.

A wrong field converts without complaint and fails much later, far from its cause (transformers
blaming its own version, a context of -1 tokens); here it is named while it is cheap to fix.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import ConfigMismatch
from .naming import LAYER_COUNT_KEYS, TensorRouter

# Sizes transformers needs as positive integers, where a config has them (None: the model's default).
POSITIVE_INTEGERS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "n_layer", "n_embd", "n_head",
    "n_inner", "n_positions", "n_ctx", "num_layers",
)
FIX = "fix it in config.json, or use the config.json that came with this checkpoint"


def check_config(config: dict, router: TensorRouter, shape_of: Callable[[str], list[int] | None]) -> None:
    """Raise ConfigMismatch naming the first field that cannot be right; `shape_of(name)` reads one
    tensor's shape from its shard's header (the embedding's, to compare with vocab_size)."""
    for prefix, body in _scopes(config):
        for key in POSITIVE_INTEGERS:
            value = body.get(key)
            if value is not None and (type(value) is not int or value <= 0):
                raise ConfigMismatch(f"config.json {prefix}{key} is {value!r}, not a positive integer; {FIX}.")
    _check_layers(config, router.blocks())
    _check_vocabulary(config, router.embedding(), shape_of)


def _check_layers(config: dict, blocks: set[int]) -> None:
    """The layer count must number exactly the blocks the tensors fill (more blocks than it counts
    are refused where they are routed)."""
    key = next((k for k in LAYER_COUNT_KEYS if k in config), None)
    lacking = sorted(set(range(config[key])) - blocks) if key and blocks else []
    if lacking:
        held = f"{len(blocks)} blocks" + (f" (0-{max(blocks)})" if len(blocks) == max(blocks) + 1 else "")
        raise ConfigMismatch(
            f"config.json {key} is {config[key]} but the checkpoint's tensors hold {held}, none for block "
            f"{lacking[0]}; set {key} to the number of blocks, or use the config.json that came with this checkpoint."
        )


def _check_vocabulary(config: dict, embedding: str | None, shape_of: Callable[[str], list[int] | None]) -> None:
    prefix, body = next(((p, b) for p, b in _scopes(config) if "vocab_size" in b), ("", {}))
    vocab = body.get("vocab_size")
    shape = shape_of(embedding) if embedding and vocab is not None else None
    if shape and shape[0] != vocab:
        raise ConfigMismatch(
            f"config.json {prefix}vocab_size is {vocab} but the embedding {embedding} has {shape[0]} rows; "
            f"set vocab_size to {shape[0]}, or use the config.json that came with this checkpoint."
        )


def _scopes(config: dict) -> list[tuple[str, dict]]:
    """The config itself and, for models that wrap a language model, its text_config."""
    text = config.get("text_config")
    return [("", config)] + ([("text_config.", text)] if isinstance(text, dict) else [])
