"""Store tensors -> a model's parameters, and putting them into (and out of) a meta-built model.

A store keeps the checkpoint's tensor names, but transformers 5 models may name and shape their
parameters differently (Mixtral's per-expert `w1/w2/w3` become fused 3-D `gate_up_proj`/`down_proj`).
`from_pretrained` fixes this with a per-family list of renamings and converters; `WeightMapper`
applies that same list to one part at a time, so every family loads exactly as from_pretrained would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from copy import deepcopy

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from ..quant import QuantizedTensor


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on `meta` (no memory) but real buffers.

    Buffers such as rotary `inv_freq` are computed in `__init__` and are not in checkpoints, so they
    must be real; parameters come from the store later.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            kept = module._parameters[name]
            module._parameters[name] = nn.Parameter(kept.to("meta"), requires_grad=kept.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


class WeightMapper:
    """Renames and converts checkpoint tensors into the model's parameter names and shapes. `renames`: checkpoint
    name prefixes to read as others first, or (None) to leave out (a model of some blocks only numbers them from
    0: meta.block_renames)."""

    def __init__(self, model: nn.Module, renames: dict[str, str | None] | None = None):
        self._renames = renames or {}
        mapping = get_model_conversion_mapping(model)
        self._renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self._converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._prefix = model.base_model_prefix
        self._expected = model.state_dict()  # meta tensors: names, shapes, dtypes; no memory
        self._model = model
        self._renamed: dict[str, tuple[str, str | None]] = {}
        # checkpoint keys whose half-precision matrix a float32 model holds as stored (half_linear.py);
        # set by loader.BlockLoader.pack_linear_weights
        self.held_as_stored: frozenset[str] = frozenset()

    def _rename(self, key: str) -> tuple[str, str | None]:
        """The parameter name (and converter pattern) of a checkpoint key; remembered, since a streamed
        block's keys are renamed again on every pass, and transformers' regexes are a large part of what
        converting them costs (docs/BENCHMARKS.md, section "Many tokens per weight read")."""
        if key not in self._renamed:
            old = next((old for old in self._renames if key.startswith(old)), None)
            if old is not None and self._renames[old] is None:
                self._renamed[key] = ("", None)   # no parameter is named ""
                return self._renamed[key]
            local = key if old is None else self._renames[old] + key[len(old):]
            renamed, pattern = rename_source_key(local, self._renamings, self._converters, self._prefix, self._expected)
            self._renamed[key] = (local, None) if renamed not in self._expected and local in self._expected else (renamed, pattern)
        return self._renamed[key]

    def target_names(self, keys: list[str]) -> set[str]:
        """The parameter names that loading these checkpoint keys fills (names only, no tensors)."""
        names = set()
        for key in keys:
            renamed, pattern = self._rename(key)
            if renamed not in self._expected:
                continue
            if pattern is None:
                names.add(renamed)
            else:
                converter = self._by_pattern[pattern]
                first = converter.target_patterns[0]
                names.update(renamed.replace(first, t) for t in converter.target_patterns)
        return names & self._expected.keys()

    def fused_source(self, key: str) -> tuple[str, int] | None:
        """Where a converter fuses checkpoint key `key` into a bigger parameter (an expert's w1 into the experts'
        `gate_up_proj`): that parameter's name and the key's place among the converter's sources; else None."""
        renamed, pattern = self._rename(key)
        if pattern is None or renamed not in self._expected:
            return None
        return renamed, self._by_pattern[pattern].source_patterns.index(pattern)

    def convert(self, tensors: dict[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor | QuantizedTensor]:
        """Checkpoint tensors of one part -> {parameter name: tensor in the parameter's dtype}; packed quantized
        weights and those `held_as_stored` (only ever asked for where `linear_weight` names one) pass as they are."""
        out: dict[str, torch.Tensor] = {}
        stored: set[str] = set()
        pending: dict[str, WeightConverter] = {}
        for key in sorted(tensors, key=dot_natural_key):
            renamed, pattern = self._rename(key)
            if renamed not in self._expected:
                continue  # e.g. rotary inv_freq saved by old checkpoints: the model computes its own
            if pattern is None:
                out[renamed] = tensors[key]
                if key in self.held_as_stored:
                    stored.add(renamed)
            else:
                converter = pending.setdefault(renamed, deepcopy(self._by_pattern[pattern]))
                converter.add_tensor(renamed, key, pattern, tensors[key])
        for name, converter in pending.items():
            for target, value in converter.convert(name, model=self._model, config=self._model.config).items():
                out[target] = value[0] if isinstance(value, list) else value
        cast: dict[tuple[int, torch.dtype], torch.Tensor] = {}   # a tied tensor (one object, two names) cast once

        def to_dtype(name: str, tensor: torch.Tensor) -> torch.Tensor:
            dtype = self._expected[name].dtype
            if (id(tensor), dtype) not in cast:
                cast[id(tensor), dtype] = tensor.to(dtype)
            return cast[id(tensor), dtype]

        return {name: t if isinstance(t, QuantizedTensor) or name in stored else to_dtype(name, t)
                for name, t in out.items() if name in self._expected}

    def nbytes(self, name: str) -> int:
        """Bytes parameter `name` takes in memory (in the model's dtype, whatever the store's)."""
        return self._expected[name].nbytes

    def dtype(self, name: str) -> torch.dtype:
        """Parameter `name`'s dtype in the model."""
        return self._expected[name].dtype

    def linear_weight(self, key: str, linear_weights: set[str]) -> str | None:
        """The one of `linear_weights` that checkpoint key `key` becomes as it is (no converter), if any."""
        renamed, pattern = self._rename(key)
        return renamed if pattern is None and renamed in linear_weights else None


class Slots:
    """The parameter and buffer slots of one module tree, to fill with real tensors and empty again."""

    def __init__(self, root: nn.Module, prefix: str = "", exclude: tuple[str, ...] = ()):
        self._prefix = prefix + "." if prefix else ""
        self._meta: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
        for module_name, module in root.named_modules():
            if any(module_name == skip or module_name.startswith(skip + ".") for skip in exclude):
                continue
            for attr, value in [*module._parameters.items(), *module._buffers.items()]:
                if value is not None and value.device.type == "meta":
                    full = self._prefix + (f"{module_name}.{attr}" if module_name else attr)
                    self._meta[full] = (module, attr, value)

    @property
    def names(self) -> set[str]:
        return set(self._meta)

    @property
    def nbytes(self) -> int:
        """Memory the filled slots take (the in-memory dtype, not the stored, maybe quantized, size)."""
        return sum(meta.numel() * meta.element_size() for _, _, meta in self._meta.values())

    def fill(self, tensors: dict[str, torch.Tensor | QuantizedTensor]) -> None:
        """Point every slot at its tensor (no copy); a packed weight (quantized, or held in another dtype than
        its slot's: WeightMapper.held_as_stored) goes to its module's `packed` and the slot stays on meta."""
        for name, tensor in tensors.items():
            module, attr, meta = self._meta[name]
            if isinstance(tensor, QuantizedTensor) or tensor.dtype != meta.dtype:
                module.packed = tensor
            elif attr in module._parameters:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor

    def empty(self, names: frozenset[str] | set[str] | None = None) -> None:
        """Back to meta (only `names` when given), dropping the references so the memory can be freed."""
        for name, (module, attr, meta) in self._meta.items():
            if names is not None and name not in names:
                continue
            module.__dict__.pop("packed", None)
            if attr in module._parameters:
                module._parameters[attr] = meta
            else:
                module._buffers[attr] = meta
