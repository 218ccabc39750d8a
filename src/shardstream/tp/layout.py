"""Which rows or columns of each weight one rank holds: the layout rules of transformers' TP plans.

A model's `base_model_tp_plan` names its column-parallel Linears (q/k/v, gate/up: each rank computes
some output features) and its row-parallel ones (o_proj, down_proj: each rank multiplies its share of
the input features, then the partial sums are all-reduced). Attention is split by whole heads; with
fewer KV heads than ranks, each rank keeps the one KV head its query heads use (replicated). Fused
projections are taken apart at load time: a rank's `qkv_proj` is its q heads, then its k and v heads;
its `gate_up_proj` is its share of the gate half, then the same share of the up half. The input
embedding and the LM head are split by vocabulary. Everything else (norms, rotary buffers) is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..errors import UnsupportedModel

# families whose attention and MLP code runs unchanged on a rank's share of heads, and whose MoE experts
# run on a rank's whole experts (experts.py) (tests/test_tp.py)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
FUSED_QKV = "qkv_proj"
FUSED_GATE_UP = "gate_up_proj"

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Take:
    """A rank's share of one tensor: these ranges along `dim`, concatenated (dim None: all of it)."""

    dim: int | None
    ranges: Ranges = ()
    zeros: bool = False   # nothing to read: the rank holds zeros (a row-parallel bias beyond rank 0)

    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


WHOLE = Take(None)
ZEROS = Take(None, zeros=True)


@dataclass(frozen=True)
class Heads:
    """Attention heads of one rank: query heads [q_first, q_first + q_count), KV heads likewise."""

    q_first: int
    q_count: int
    kv_first: int
    kv_count: int
    head_dim: int


def _share(total: int, rank: int, size: int, what: str, field: str) -> tuple[int, int]:
    if total % size:
        raise UnsupportedModel(
            f"config.json {field} is {total}: {what} cannot be split equally over {size} ranks; "
            f"start a number of ranks that divides {total}."
        )
    step = total // size
    return rank * step, (rank + 1) * step


def rank_heads(config, rank: int, size: int) -> Heads:
    """The rank's heads; KV heads are replicated when there are fewer of them than ranks."""
    q_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    q_first, q_stop = _share(q_heads, rank, size, "attention heads", "num_attention_heads")
    if kv_heads % size == 0:
        kv_first, kv_count = rank * kv_heads // size, kv_heads // size
    elif size % kv_heads == 0:
        kv_first, kv_count = rank // (size // kv_heads), 1   # this rank's query heads all use this KV head
    else:
        raise UnsupportedModel(
            f"config.json num_key_value_heads is {kv_heads}, which neither divides nor is divided by {size} "
            "ranks; start a number of ranks that is a multiple or a divisor of it."
        )
    return Heads(q_first, q_stop - q_first, kv_first, kv_count, head_dim)


def check_family(config, instead: str) -> None:
    """Refuse a model that tensor-parallel ranks do not run (its family not in FAMILIES, or without a TP plan
    in transformers), saying `instead` what to do; the ranks and `shardstream shard --tp` share this rule."""
    family = config.model_type
    if family not in FAMILIES or not getattr(config, "base_model_tp_plan", None):
        raise UnsupportedModel(
            f"tensor parallelism supports model_type {', '.join(FAMILIES)}; this store's is {family!r}: {instead}."
        )


def tp_roles(model: nn.Module) -> dict[str, str]:
    """Module name -> 'column', 'row', 'vocab' (input embedding) or 'head' (LM head), from the model's
    own TP plan; modules not named are replicated."""
    config = model.config
    check_family(config, "run it without --tensor-parallel (layer streaming)")
    plan = config.base_model_tp_plan
    prefix = model.base_model_prefix + "."
    patterns = [(re.compile(re.escape(prefix + key).replace(r"\*", r"\d+") + "$"), style) for key, style in plan.items()]
    roles: dict[str, str] = {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in patterns if pattern.match(name)), None)
        if isinstance(module, nn.Linear) and style and style.startswith(("colwise", "rowwise")):
            roles[name] = "column" if style.startswith("colwise") else "row"
    named = {module: name for name, module in model.named_modules()}
    roles[named[model.get_input_embeddings()]] = "vocab"
    roles[named[model.get_output_embeddings()]] = "head"
    return roles


def take(module: str, role: str | None, kind: str, shape: list[int], config, heads: Heads,
         rank: int, size: int) -> Take:
    """The share of parameter `<module>.<kind>` (of full `shape`) this rank holds."""
    leaf = module.rpartition(".")[2]
    if role in ("vocab", "head") and kind == "weight":
        return Take(0, (_share(shape[0], rank, size, "the vocabulary", "vocab_size"),))
    if role == "row":
        if kind != "weight":   # the bias must be added once to the all-reduced sum: rank 0 adds it
            return WHOLE if rank == 0 else ZEROS
        return Take(1, (_share(shape[1], rank, size, f"{module}'s input features", "hidden sizes"),))
    if role != "column":
        return WHOLE
    d = heads.head_dim
    q_rows = (heads.q_first * d, (heads.q_first + heads.q_count) * d)
    kv_rows = (heads.kv_first * d, (heads.kv_first + heads.kv_count) * d)
    if leaf == FUSED_QKV:
        q_total = config.num_attention_heads * d
        kv_total = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * d
        return Take(0, (q_rows, tuple(q_total + r for r in kv_rows), tuple(q_total + kv_total + r for r in kv_rows)))
    if leaf == FUSED_GATE_UP:
        half = shape[0] // 2
        start, stop = _share(half, rank, size, f"{module}'s halves", "intermediate_size")
        return Take(0, ((start, stop), (half + start, half + stop)))
    if leaf == "q_proj":
        return Take(0, (q_rows,))
    if leaf in ("k_proj", "v_proj"):
        return Take(0, (kv_rows,))
    return Take(0, (_share(shape[0], rank, size, f"{module}'s output features", "intermediate_size"),))


def is_exported_block(share: Take, split_dim: int | None, full: list[int], rank: int, size: int) -> bool:
    """Whether a slice of an index written before slices had `ranges` is exactly this share: such an export
    holds one equal block of `full` along `split_dim` per rank (not a fused projection's heads and halves,
    nor a replicated KV head), and users' stores may still hold one."""
    if share.dim is None or split_dim is None:
        return share.dim == split_dim
    step = full[split_dim] // size
    return share.dim == split_dim and share.ranges == ((rank * step, (rank + 1) * step),)

