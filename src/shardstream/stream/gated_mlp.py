"""A gated MLP that holds less of its intermediate at once: in place, and in row pieces through the CPU kernels.

transformers' gated MLP (Llama's, Mistral's, Qwen2's, Qwen3's and some 130 more families share the one
line `down_proj(act_fn(gate_proj(x)) * up_proj(x))`) holds three rows x intermediate tensors at once: the
activation, the up projection and their product. They are a prefill's largest temporaries
(docs/BENCHMARKS.md, "Beside llama.cpp on the CPU", has their sizes and the peaks). The engine's MLP does two
things instead:
- it multiplies the up projection into the activation in place: two tensors, the same bits (the same
  elementwise product, written into the activation's memory). Where autograd records the pass (a tensor
  involved requires grad) the product is a new tensor, as an in-place write would spoil what backward needs;
- where its projections multiply through the engine's CPU kernels (bf16/fp16 weights held as stored beside
  float32 activations, quantized codes: `FewRowsLinear.packed`), it runs the rows in pieces whose
  intermediate is at most `PIECE_BYTES`. Those kernels give a row the same bits in any batch and run as
  fast from a few dozen rows on, so the pieces change nothing but the memory. torch's own products keep
  the rows whole: a row's bits and their speed depend on the rows beside it (oneDNN's bf16 products on
  AMX run a long prompt's MLP slower in pieces). Nor do projections that hooks watch: a streamed block's
  pieces are filled and emptied by their modules' hooks, once a pass, and a second call would read its
  piece again.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from .lean import use_forward

# Bytes of one rows x intermediate tensor in a piece: small enough to stay off a prefill's peak, large
# enough that a piece's products run as fast as the whole (docs/BENCHMARKS.md, "Beside llama.cpp on the CPU").
PIECE_BYTES = 8 << 20


def use_lean_mlps(model: nn.Module) -> None:
    """Give every module of `model` whose forward is transformers' gated MLP the engine's forward (same
    module tree, same parameters)."""
    use_forward(model, LlamaMLP.forward, lean_forward)


def lean_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, its product written into the activation, a piece of
    rows at a time (see the module docstring)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    piece = _piece_rows(self, x, rows)
    if rows <= piece:
        return _in_place(self, x)
    flat = x.reshape(rows, x.shape[-1])
    out = None
    for start in range(0, rows, piece):
        part = _in_place(self, flat[start:start + piece])
        if out is None:
            out = part.new_empty(rows, part.shape[-1])
        out[start:start + len(part)] = part
    return out.view(*x.shape[:-1], out.shape[-1])


def _in_place(self, x: torch.Tensor) -> torch.Tensor:
    hidden = self.act_fn(self.gate_proj(x))
    up = self.up_proj(x)
    hidden = hidden * up if hidden.requires_grad or up.requires_grad else hidden.mul_(up)
    return self.down_proj(hidden)


def _piece_rows(self, x: torch.Tensor, rows: int) -> int:
    """Rows whose intermediate fits PIECE_BYTES where every projection multiplies through the engine's CPU
    kernels and no hook counts its calls; else all `rows`."""
    if x.device.type != "cpu" or any(getattr(p, "packed", None) is None or p._forward_pre_hooks or p._forward_hooks
                                     for p in (self.gate_proj, self.up_proj, self.down_proj)):
        return rows
    return max(1, PIECE_BYTES // (self.gate_proj.out_features * x.element_size()))
