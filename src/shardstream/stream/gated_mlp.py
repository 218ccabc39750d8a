"""A gated MLP whose product of activation and up projection is written in place.

transformers' gated MLP (Llama's, Mistral's, Qwen2's, Qwen3's and some 130 more families share the one
line `down_proj(act_fn(gate_proj(x)) * up_proj(x))`) holds three rows x intermediate tensors at once: the
activation, the up projection and their product. They are a prefill's largest temporaries (a 512-token
prompt of a 1B model: 16 MiB each in float32). Multiplying the up projection into the activation in place
holds two, and gives the same bits: the same products and the same elementwise multiplication, written
into the activation's memory instead of a new tensor. Where autograd records the pass (a tensor involved
requires grad) the product is a new tensor, as an in-place write would spoil what backward needs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP


def use_lean_mlps(model: nn.Module) -> None:
    """Give every module of `model` whose forward is transformers' gated MLP the in-place forward (same
    module tree, same parameters)."""
    for module in model.modules():
        if _is_gated_mlp(type(module)):
            module.__class__ = _lean(type(module))


def lean_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, its product written into the activation."""
    hidden = self.act_fn(self.gate_proj(x))
    up = self.up_proj(x)
    hidden = hidden * up if hidden.requires_grad or up.requires_grad else hidden.mul_(up)
    return self.down_proj(hidden)


@functools.cache
def _is_gated_mlp(cls: type) -> bool:
    """Whether `cls.forward` is, instruction for instruction, LlamaMLP's (the families copy it verbatim)."""
    forward, reference = getattr(cls, "forward", None), LlamaMLP.forward.__code__
    code = getattr(forward, "__code__", None)
    return code is not None and all(getattr(code, field) == getattr(reference, field)
                                    for field in ("co_code", "co_names", "co_consts", "co_varnames"))


@functools.cache
def _lean(cls: type) -> type:
    return type(cls.__name__, (cls,), {"forward": lean_forward, "__doc__": lean_forward.__doc__,
                                       "__module__": __name__})
