"""Tensor-parallel slices and expert placement by tier, recorded in `<store>/sharding.json`."""

from .experts import (RELOCATION_STEPS, Expert, load_expert, parse_expert_key, parse_tiers, place_experts,
                      relocate, verify_experts_and_slices)
from .index import INDEX_NAME, load_index
from .tp import export_tp, load_tp, split_dim

__all__ = [
    "INDEX_NAME", "RELOCATION_STEPS", "Expert", "export_tp", "load_expert", "load_index", "load_tp",
    "parse_expert_key", "parse_tiers", "place_experts", "relocate", "split_dim", "verify_experts_and_slices",
]
