"""Tensor-parallel slices and expert placement by tier, recorded in `<store>/sharding.json`."""

from ..store.sharding import INDEX_NAME, Expert, load_expert, load_index, load_tp
from .experts import parse_expert_key, place_experts, relocate
from .parts import relocate_part
from .tiers import RELOCATION_STEPS, define_tiers, parse_tiers
from .tp import export_tp

__all__ = [
    "INDEX_NAME", "RELOCATION_STEPS", "Expert", "define_tiers", "export_tp", "load_expert", "load_index", "load_tp",
    "parse_expert_key", "parse_tiers", "place_experts", "relocate", "relocate_part",
]
