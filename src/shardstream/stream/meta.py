"""transformers' own model for a store's config, built with its parameters on `meta`: the shell that the
streamed model, a pipeline stage and a tensor-parallel rank each fill with the weights they hold."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ..errors import InvalidOption, UnsupportedModel
from ..store import Store
from .compute_dtype import resolve_compute_dtype
from .decode_attention import use_decode_attention
from .gated_mlp import use_lean_mlps
from .linear import use_streaming_layers
from .rms_norm import use_lean_norms
from .weights import parameters_on_meta


def build_meta_model(store: Store, dtype: str | torch.dtype | None, device: torch.device | None = None,
                     blocks: range | None = None) -> PreTrainedModel:
    """transformers' model class for the store's config, with parameters on `meta`, in `dtype` (None: the
    checkpoint's); given the `device` it will run on, `dtype` is a compute_dtype option ('auto': the dtype
    that is fast there, see compute_dtype.py). `blocks`: only these of the store's blocks, numbered from 0
    (a pipeline stage's), so that the model's KV cache, positions and masks count exactly those layers."""
    try:
        config = AutoConfig.from_pretrained(store.root)
        if blocks is not None:
            config.num_hidden_layers = len(blocks)
            if getattr(config, "layer_types", None):
                config.layer_types = [config.layer_types[i] for i in blocks]
        stored = config_dtype(config)
        dtype = resolve_compute_dtype(dtype, stored, device) if device is not None else dtype or stored
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except InvalidOption:   # a ValueError too: the option or SHARDSTREAM_CPU_FLAGS, already in one sentence
        raise
    except (ValueError, KeyError) as error:
        raise UnsupportedModel(
            f"{store.root / 'config.json'}: transformers has no causal LM for model_type "
            f"{store.config.get('model_type')!r} ({error}); use a text-generation model."
        ) from None
    use_streaming_layers(model)
    use_lean_mlps(model)
    use_lean_norms(model)
    use_decode_attention(model)
    return model.eval()


def block_renames(store: Store, blocks: range) -> dict[str, str | None]:
    """Checkpoint name prefixes of the store's blocks -> those of `blocks` numbered from 0 ('model.layers.7.' ->
    'model.layers.0.' for a range starting at block 7), as the model `build_meta_model` made for them names
    them, and the others' -> None: their tensors fill nothing there."""
    renames: dict[str, str | None] = {}
    for block in range(store.num_layers):
        prefix = common_module(set(store.tensor_names(f"mid/{block}")))
        container, _, number = prefix.rpartition(".")
        if not number.isdigit():
            raise UnsupportedModel(f"block {block} of the store at {store.root} ({prefix!r}) is not an item of a "
                                   "module list; run this family's blocks all together.")
        renames[prefix + "."] = f"{container}.{block - blocks.start}." if block in blocks else None
    return renames


def checkpoint_dtype(store: Store) -> torch.dtype:
    """The dtype the store's checkpoint was saved in (its config's), whatever the model computes in."""
    return config_dtype(AutoConfig.from_pretrained(store.root))


def config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def common_module(names: set[str]) -> str:
    """The deepest module name that contains every one of these parameter names."""
    split = [name.split(".")[:-1] for name in names]
    prefix = os.path.commonprefix(split)
    return ".".join(prefix)


class WrapsModel:
    """What callers read from a transformers model, read from the one `self.model` wraps: the streamed
    model, a tensor-parallel rank and the engine calls replayed over ranks all stand in for one."""

    model: PreTrainedModel

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config
