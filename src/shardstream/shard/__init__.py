"""Tensor-parallel slices and expert placement by tier, recorded in `<store>/sharding.json`."""

from ..store.sharding import INDEX_NAME, Expert, load_expert, load_index, load_tp
from .experts import RELOCATION_STEPS, parse_expert_key, parse_tiers, place_experts, relocate, verify_experts_and_slices
from .tp import export_tp, split_dim

__all__ = [
    "INDEX_NAME", "RELOCATION_STEPS", "Expert", "export_tp", "load_expert", "load_index", "load_tp",
    "parse_expert_key", "parse_tiers", "place_experts", "relocate", "split_dim", "verify_experts_and_slices",
]
