"""A store whose tensors disagree with its config.json is refused when it is opened, before any pass.

transformers' model built from config.json on `meta` has every parameter's shape; the manifest has every
stored tensor's. Compared once, reading no tensor data, they catch a config.json from another model, or
a tensor-parallel rank's share folder opened as a whole store (its weights hold 1/N of the heads the
config names): streaming would otherwise compute from them, or fail deep in a pass.
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigMismatch
from ..store import Store
from .weights import WeightMapper


def check_stored_shapes(store: Store, model: nn.Module, mapper: WeightMapper) -> None:
    """Every stored tensor that becomes a parameter as it is (no converter: fused MoE experts are built
    from several) must have that parameter's shape (a quantized tensor's shape before quantization)."""
    expected = {name: list(tensor.shape) for name, tensor in model.state_dict(keep_vars=True).items()}
    for part in store.parts:
        for key, shape in store.tensor_shapes(part).items():
            name = mapper.linear_weight(key, expected.keys())
            if name is not None and list(shape) != expected[name]:
                raise ConfigMismatch(
                    f"the store at {store.root} holds {key} as {list(shape)}, but its config.json makes {name} "
                    f"{expected[name]}: the tensors and config.json are of different models; put back the "
                    "config.json the checkpoint came with, or convert that checkpoint again."
                )
